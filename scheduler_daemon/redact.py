"""Secrets out of text: what every printed URL, error message and log line goes through.

The one place redaction lives. It imports nothing from the package, so every layer uses
it: ``config.url`` (a ``DatabaseUrl`` prints itself redacted), ``config`` and
``check-config``, ``errors.describe``, ``logs`` (every value of every line, the stdlib
loggers' included), ``status`` and ``http``.

:func:`redact` hides, in any text (a URL, a DSN, an error message quoting one):

- the password of ``scheme://user:password@host`` -- up to the *last* ``@`` before the
  next whitespace, so a raw ``@`` (or ``:``, ``/``, ``#``, ``?``) in the password does not
  leak its tail. libpq and asyncpg disagree about such a URL (libpq ends the user info at
  the first ``@`` or ``/``, asyncpg at the last ``@``): hiding up to the last one can hide
  too much (a host, when a later ``@`` follows), never too little;
- the value of a secret-bearing parameter (``password``, ``sslpassword``, anything ending
  in ``password``, ``passwd`` or ``secret`` such as libpq's ``oauth_client_secret``,
  ``token``, ``access_token``, ``api_key``): in a URL query (``?sslpassword=…&``, up to
  the next ``&``), in a key=value DSN (``password=secret``, ``password = 'a b'`` with
  libpq's ``\\'`` escapes), and quoted as in a ``repr`` or JSON (``'password': '…'``).

:func:`redact_webhook_url` is stricter, for URLs that carry their secret anywhere (a
hook's token in its path): it keeps the scheme and host only.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

REDACTED = "***"

# scheme://user:password@ -- the user cannot hold ":", "/", "@", "?", "#" (they would end
# it); the password is everything up to the last "@" of the whitespace-free run.
_USERINFO_PASSWORD = re.compile(
    r"(?P<head>(?<![\w+.-])[a-zA-Z][\w+.-]*://[^\s:/@?#]*:)(?P<secret>\S*)(?=@)"
)
_SECRET_KEY = r"(?:[\w.-]*(?:password|passwd|secret)|(?:access_)?token|api_?key)"
# An unquoted value gives back up to two punctuation marks it ends with, so that the text
# around it keeps its shape ("(…?sslpassword=***)", "'…?password=***':") and redacting
# twice changes nothing. (A password is never shown whole: at most its last two marks.)
_TAIL = r"(?P<tail>[)\]}>'\",;.:]{0,2})"
# ?password=…&: a query value ends at "&" or "#" (a raw one cannot be part of it).
_QUERY_SECRET = re.compile(
    rf"(?P<head>[?&]{_SECRET_KEY}=)(?P<secret>[^&#\s]*?){_TAIL}(?=[&#\s]|$)", re.I
)
# key=value DSNs and messages (libpq allows spaces around "="), and a quoted key before
# ":" as in a dict's repr or JSON. A quoted value runs to its closing quote (to the end of
# the text if there is none); an unquoted one to the next whitespace.
_KEYWORD_SECRET = re.compile(
    rf"""(?P<head>(?<![\w.?&-])(?:(?P<q>['"]){_SECRET_KEY}(?P=q)\s*[:=]|{_SECRET_KEY}\s*=)\s*)
    (?:(?P<secret>'(?:[^'\\]|\\.)*(?:'|$)|"(?:[^"\\]|\\.)*(?:"|$))
      |(?P<bare>[^\s'"]\S*?){_TAIL}(?=\s|$))""",
    re.I | re.S | re.X,
)


def _hide(match: re.Match[str]) -> str:
    return match["head"] + REDACTED + (match.groupdict().get("tail") or "")


# Each pattern above needs "://" or one of these words (_SECRET_KEY), case aside: text
# with none of them is returned as it is, without running the patterns (every value of
# every log line goes through here: most hold no secret).
_NEEDS_A_LOOK = ("passw", "secret", "token", "apikey", "api_key")


def redact(text: str) -> str:
    """``text`` without the passwords of any URLs and DSNs in it (see the module doc)."""
    if "://" not in text:
        lowered = text.lower()
        if not any(word in lowered for word in _NEEDS_A_LOOK):
            return text
    text = _USERINFO_PASSWORD.sub(_hide, text)
    text = _QUERY_SECRET.sub(_hide, text)
    return _KEYWORD_SECRET.sub(_hide, text)


def redact_webhook_url(url: str) -> str:
    """Scheme and host only (``https://hooks.example.com/***``): hook URLs often carry
    their secret in the user info, the path or the query."""
    try:
        parts = urlsplit(url.strip())
        host, port = parts.hostname, parts.port
    except ValueError:
        return REDACTED
    if not parts.scheme or not host:
        return REDACTED
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}/{REDACTED}"
