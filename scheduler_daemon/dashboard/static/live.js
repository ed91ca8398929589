// Live parts of a dashboard page: the server renders the fragment again and sends it
// (server-sent events) when it changed; times are shown in the viewer's zone, UTC on hover.
"use strict";

function localTimes(root) {
  const format = new Intl.DateTimeFormat(undefined, {
    year: "numeric", month: "2-digit", day: "2-digit",
    hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short",
  });
  for (const el of root.querySelectorAll("time[datetime]")) {
    const when = new Date(el.getAttribute("datetime"));
    if (!Number.isNaN(when.getTime())) el.textContent = format.format(when);
  }
}

function follow(region) {
  const state = document.getElementById("live-state");
  const source = new EventSource(region.dataset.live);
  source.addEventListener("fragment", (event) => {
    // Keep the keyboard focus where it was, if the same control is still there.
    const focused = document.activeElement && document.activeElement.closest("#live")
      ? document.activeElement.getAttribute("href") || document.activeElement.getAttribute("action")
      : null;
    region.innerHTML = event.data;
    localTimes(region);
    if (focused) {
      const again = region.querySelector(`[href="${CSS.escape(focused)}"], [action="${CSS.escape(focused)}"]`);
      if (again) again.focus();
    }
    if (state) state.textContent = "live";
  });
  source.onerror = () => { if (state) state.textContent = "reconnecting…"; };
}

document.addEventListener("DOMContentLoaded", () => {
  localTimes(document);
  const region = document.getElementById("live");
  if (region && region.dataset.live && "EventSource" in window) follow(region);
});
