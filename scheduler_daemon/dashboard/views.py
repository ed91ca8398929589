"""The dashboard's pages, their live parts, and its actions, on the daemon's aiohttp app.

Every page is rendered on the server (Jinja2) and works without JavaScript. Its live part
is a fragment with a name (``cluster``, ``schedules``, …): the page's small script opens
``/live/<fragment>?<the page's query>`` (server-sent events), and the server renders the
fragment again every ``dashboard.refresh`` and sends it when it changed. Nothing about the
cluster is kept in this process: each rendering reads the database and the lock manager.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web
from aiohttp_sse import sse_response
from markupsafe import Markup

from ..aio import wait_any
from ..config.settings import Settings
from ..db.base import COUNT_LIMIT, Store
from ..db.publications import PublishStore
from ..db.schedules import ScheduleStore
from ..errors import InvalidInput, NotFound, describe
from ..logs import Logger
from ..output import counted
from ..status import summarize
from .auth import Credentials, challenge, read_password, same_origin
from .reads import TIMELINE_RUNS, PublicationView, Reads, RunPage, ScheduleQuery, timeline

# A rendering reads a handful of rows through indexes; past this the database is unwell.
READ_TIMEOUT = 5.0
RUN_HISTORY = 50
TIMELINE_WINDOW = 600.0  # seconds the runs timeline spans at most
PAGE = 50
SCHEDULE_ACTIONS: dict[str, Callable[[ScheduleStore, str], Awaitable[bool]]] = {
    "pause": ScheduleStore.pause,
    "resume": ScheduleStore.resume,
    "trigger": ScheduleStore.trigger,
}

Context = dict[str, Any]
Fragment = Callable[[web.Request], Awaitable[Context]]


def loopback_only(host: str) -> bool:
    """Whether ``host`` (``http.host``) binds loopback addresses only: then only this
    machine's users reach the pages, and they show detail without an opt-in."""
    try:
        infos = socket.getaddrinfo(host or None, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def shows_detail(settings: Settings) -> bool:
    """Payloads, errors, host names and pids: on a port only this machine reaches, or
    where the operator opted in (``http.status_detail``); else ``/status``'s summary."""
    return settings.http.status_detail or loopback_only(settings.http.host)


@dataclass(frozen=True)
class Page:
    template: str
    title: str
    fragment: str


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("scheduler_daemon.dashboard", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["span"] = _span
    env.filters["pretty"] = _pretty
    env.filters["counted"] = lambda value: counted(value, COUNT_LIMIT)
    env.filters["number"] = lambda value: f"{value:,}"
    static = files("scheduler_daemon.dashboard").joinpath("static")
    versions = {
        entry.name: hashlib.sha256(entry.read_bytes()).hexdigest()[:12]
        for entry in static.iterdir()
        if entry.is_file()
    }
    # Named by content, so a browser never runs an old script against a new page.
    env.globals["static"] = lambda name: f"/static/{name}?v={versions[name]}"
    return env


def _as_datetime(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def _when(value: Any) -> Any:
    """A time as ``<time>``: UTC in the page, the viewer's own zone once the script ran,
    UTC on hover either way."""
    moment = _as_datetime(value)
    if moment is None:
        return "—"
    moment = moment.astimezone(UTC)
    iso = moment.isoformat().replace("+00:00", "Z")
    text = moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    return Markup(f'<time datetime="{iso}" title="{text}">{text}</time>')


def _span(seconds: Any) -> str:
    if seconds is None:
        return "—"
    value = float(seconds)
    if abs(value) < 1:
        return f"{value * 1000:.0f} ms"
    if abs(value) < 120:
        return f"{value:.1f} s"
    if abs(value) < 7200:
        return f"{value / 60:.1f} min"
    return f"{value / 3600:.1f} h"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


class Dashboard:
    """Add the dashboard's routes to ``app``. ``store`` is asked for at each request: the
    HTTP server answers while the daemon is still starting."""

    def __init__(
        self,
        settings: Settings,
        store: Callable[[], Store | None],
        log: Logger,
        closing: asyncio.Event,
    ) -> None:
        self.settings = settings
        self.closing = closing
        # One read at a time, whatever the number of open pages: the dashboard holds at
        # most one pooled connection (config.transaction_pool_users counts it).
        self._reading = asyncio.Semaphore(1)
        self.dashboard = settings.dashboard
        self._store = store
        self.log = log.bind(component="dashboard")
        self.detail = shows_detail(settings)
        password = read_password(self.dashboard) if self.dashboard.actions else None
        self.credentials = (
            Credentials(self.dashboard.user, password) if password is not None else None
        )
        self.env = _environment()
        self.fragments: dict[str, Fragment] = {
            "cluster": self._cluster,
            "schedules": self._schedules,
            "schedule": self._schedule,
            "runs": self._runs,
            "run": self._run,
            "publications": self._publications,
            "publication": self._publication,
        }

    def routes(self, app: web.Application) -> None:
        pages = {
            "/": Page("cluster.html", "Cluster", "cluster"),
            "/schedules": Page("schedules.html", "Schedules", "schedules"),
            "/schedules/{name}": Page("schedule.html", "Schedule", "schedule"),
            "/runs": Page("runs.html", "Runs", "runs"),
            "/runs/{id:\\d+}": Page("run.html", "Run", "run"),
            "/publications": Page("publications.html", "Publications", "publications"),
            "/publications/{id:\\d+}": Page("publication.html", "Publication", "publication"),
        }
        for path, page in pages.items():
            app.router.add_get(path, self._page_handler(page))
        app.router.add_get("/live/{fragment}", self._live)
        app.router.add_get("/live/{fragment}/{key}", self._live)
        app.router.add_get("/login", self._login)
        app.router.add_post("/actions/schedules/{name}/{action}", self._schedule_action)
        app.router.add_post("/actions/publications/{id:\\d+}/{action}", self._publication_action)
        static = files("scheduler_daemon.dashboard").joinpath("static")
        app.router.add_static("/static/", str(static))

    # -- rendering ------------------------------------------------------------------------

    def _page_handler(self, page: Page) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            context = await self._render_context(page.fragment, request)
            key = _key(request)
            live = f"/live/{page.fragment}" + (f"/{_quote(key)}" if key else "")
            if request.query_string:
                live += f"?{request.query_string}"
            html = self.env.get_template(page.template).render(
                **context, page=page, live_url=live, nav=page.fragment
            )
            status = context.get("status_code", 200)
            return web.Response(
                text=html, content_type="text/html", charset="utf-8", status=status,
                headers=_SECURITY_HEADERS,
            )  # fmt: skip

        return handler

    async def _render_context(self, fragment: str, request: web.Request) -> Context:
        user = self.credentials.identify(request) if self.credentials is not None else None
        base: Context = {
            "detail": self.detail,
            "instance": self.settings.instance_id,
            "actions": self.credentials is not None,
            "user": user,
            "csrf": (lambda path: self.credentials.csrf_token(user, path))
            if self.credentials is not None and user is not None
            else None,
            "request_path": request.path_qs,
        }
        store = self._store()
        if store is None:
            return base | {"unavailable": "starting: not connected to the database yet",
                           "status_code": 503}  # fmt: skip
        try:
            async with asyncio.timeout(READ_TIMEOUT), self._reading:
                found = await self.fragments[fragment](request)
        except web.HTTPException:
            raise
        except TimeoutError:
            return base | {"unavailable": f"the database did not answer within {READ_TIMEOUT:g}s",
                           "status_code": 503}  # fmt: skip
        except Exception as exc:
            self.log.debug("dashboard.read_failed", fragment=fragment, error=describe(exc))
            why = describe(exc) if self.detail else f"{type(exc).__name__} (details in the log)"
            return base | {"unavailable": f"database: {why}", "status_code": 503}
        return base | found

    async def _live(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the fragment, rendered anew every ``refresh``, sent when
        it changed (a comment line now and then keeps proxies from closing it)."""
        fragment = request.match_info["fragment"]
        if fragment not in self.fragments:
            raise web.HTTPNotFound()
        template = self.env.get_template(f"_{fragment}.html")
        async with sse_response(request, headers=_SECURITY_HEADERS) as events:
            last = b""
            while events.is_connected() and not self.closing.is_set():
                context = await self._render_context(fragment, request)
                html = template.render(**context)
                digest = hashlib.sha256(html.encode()).digest()
                if digest != last:
                    last = digest
                    await events.send(html, event="fragment")
                await wait_any([self.closing], self.dashboard.refresh)
        return events

    # -- the fragments' data ---------------------------------------------------------------

    def _reads(self) -> Reads:
        store = self._store()
        assert store is not None  # _render_context checked
        return Reads(store, self.settings)

    async def _cluster(self, request: web.Request) -> Context:
        report = await self._reads().cluster()
        if not self.detail:
            report = summarize(report)
        return {"report": report}

    async def _schedules(self, request: web.Request) -> Context:
        page = await self._reads().schedules(schedule_query(request.query), PAGE)
        return {"schedules": page}

    async def _schedule(self, request: web.Request) -> Context:
        name = _key(request)
        record, runs = await self._reads().schedule(name, RUN_HISTORY)
        if record is None:
            return {"missing": f"no schedule named {name!r}", "status_code": 404, "name": name}
        return {"schedule": record, "runs": runs, "name": name}

    async def _runs(self, request: web.Request) -> Context:
        failed = request.query.get("failed") == "1"
        before = _number(request.query.get("before"))
        reads = self._reads()
        if before is not None:
            return {"runs": await reads.runs(failed, before, PAGE), "timeline": None}
        # The newest page of runs is the start of what the timeline pictures: one read.
        latest = await reads.runs(False, None, TIMELINE_RUNS)
        page = (
            await reads.runs(True, None, PAGE)
            if failed
            else RunPage(latest.runs[:PAGE], False, None, PAGE)
        )
        return {"runs": page, "timeline": timeline(latest.runs, TIMELINE_WINDOW)}

    async def _run(self, request: web.Request) -> Context:
        run_id = _number(_key(request)) or 0
        run = await self._reads().run(run_id)
        if run is None:
            return {"missing": f"no run {run_id}", "status_code": 404, "run_id": run_id}
        return {"run": run}

    async def _publications(self, request: web.Request) -> Context:
        view: PublicationView = "recent" if request.query.get("view") == "recent" else "upcoming"
        status = request.query.get("status") or None
        if status not in (None, "published", "failed", "cancelled"):
            status = None
        after = _number(request.query.get("after"))
        page = await self._reads().publications(view, status, after, PAGE)
        return {"publications": page}

    async def _publication(self, request: web.Request) -> Context:
        pid = _number(_key(request)) or 0
        publication = await self._reads().publication(pid)
        if publication is None:
            return {"missing": f"no publication {pid}", "status_code": 404, "publication_id": pid}
        return {"publication": publication}

    # -- actions ---------------------------------------------------------------------------

    async def _login(self, request: web.Request) -> web.Response:
        """Ask the browser for the credentials (it then sends them to every page here),
        and go back to where the operator was."""
        if self.credentials is None:
            raise web.HTTPForbidden(text="actions are off (dashboard.actions)\n")
        if self.credentials.identify(request) is None:
            raise challenge()
        raise web.HTTPSeeOther(_local(request.query.get("next")))

    async def _authorize(self, request: web.Request, what: str) -> tuple[str, str]:
        """The user allowed to do ``what`` (this request's path), and where to go after;
        or the refusal, raised. Every refusal is logged, never with the credentials."""
        form = await request.post()
        go_back = _local(str(form.get("next", "")))
        if self.credentials is None:
            self._refused(request, what, None, "actions are off (dashboard.actions)")
            raise web.HTTPForbidden(text="actions are off (dashboard.actions)\n")
        user = self.credentials.identify(request)
        if user is None:
            self._refused(request, what, None, "no valid credentials")
            raise challenge()
        token = str(form.get("csrf", ""))
        if not same_origin(request) or not self.credentials.csrf_valid(token, user, request.path):
            self._refused(request, what, user, "bad or missing CSRF token, or another origin")
            raise web.HTTPForbidden(text="refused: the form's token is missing, wrong or "
                                    "expired, or it came from another site; reload the page\n")  # fmt: skip
        return user, go_back

    def _refused(self, request: web.Request, what: str, user: str | None, why: str) -> None:
        self.log.warning("dashboard.action_refused", action=what, user=user, reason=why,
                         remote=request.remote)  # fmt: skip

    async def _schedule_action(self, request: web.Request) -> web.Response:
        name, action = request.match_info["name"], request.match_info["action"]
        act = SCHEDULE_ACTIONS.get(action)
        if act is None:
            raise web.HTTPNotFound()
        user, go_back = await self._authorize(request, f"schedule.{action}")
        store = self._need_store()
        async with store.transaction() as tx:
            changed = await act(ScheduleStore(tx), name)
        self._done(request, user, f"schedule.{action}", schedule=name, changed=bool(changed))
        if not changed:
            raise web.HTTPNotFound(text=f"no schedule named {name!r}\n")
        raise web.HTTPSeeOther(go_back or f"/schedules/{_quote(name)}")

    async def _publication_action(self, request: web.Request) -> web.Response:
        pid, action = int(request.match_info["id"]), request.match_info["action"]
        if action not in ("cancel", "retry"):
            raise web.HTTPNotFound()
        user, go_back = await self._authorize(request, f"publication.{action}")
        store = self._need_store()
        try:
            if action == "cancel":
                await store.cancel(pid)
            else:
                async with store.transaction() as tx:
                    if not await PublishStore(tx).retry_failed(id=pid):
                        raise NotFound(f"publication {pid} is not failed: nothing to retry")
        except InvalidInput as exc:
            self._done(request, user, f"publication.{action}", publication=pid, changed=False)
            raise web.HTTPConflict(text=f"{exc}\n") from None
        self._done(request, user, f"publication.{action}", publication=pid, changed=True)
        raise web.HTTPSeeOther(go_back or f"/publications/{pid}")

    def _need_store(self) -> Store:
        store = self._store()
        if store is None:
            raise web.HTTPServiceUnavailable(text="starting: not connected to the database yet\n")
        return store

    def _done(self, request: web.Request, user: str, what: str, **fields: Any) -> None:
        self.log.info("dashboard.action", action=what, user=user, remote=request.remote,
                      **fields)  # fmt: skip


# The pages embed nothing from elsewhere and are never framed.
_SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self'; script-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def schedule_query(query: Mapping[str, str]) -> ScheduleQuery:
    """The schedules page's address: ``q``, a prefix of names (surrounding spaces
    dropped), and where the page is: ``after`` a name, ``before`` one, ``last=1``, or else
    the first."""
    prefix = query.get("q", "").strip()
    before, after = query.get("before") or None, query.get("after") or None
    if before is not None:
        return ScheduleQuery(prefix, before=before)
    if query.get("last") == "1":
        return ScheduleQuery(prefix, last=True)
    return ScheduleQuery(prefix, after=after)


def _number(text: str | None) -> int | None:
    """A whole number from the URL (a bigint's worth of digits), or None."""
    if text is None or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


def _key(request: web.Request) -> str:
    """The schedule's name or the id a page (``/runs/{id}``) or its live stream
    (``/live/run/{key}``) names."""
    info = request.match_info
    return info.get("name") or info.get("id") or info.get("key", "")


def _quote(text: str) -> str:
    return quote(text, safe="")


def _local(target: str | None) -> str:
    """A path on this site to go back to; anything else (another site) becomes ``/``."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target
