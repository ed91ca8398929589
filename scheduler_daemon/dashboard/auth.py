"""Who may act from the dashboard, and proof that a form came from it.

Reading needs nothing (the pages follow ``/status``'s exposure rules instead). Acting
needs ``dashboard.actions`` and HTTP Basic credentials: ``dashboard.user`` and the
password from ``dashboard.password`` or ``dashboard.password_file``. Basic, because every
browser and every script speaks it and it needs no session state on the server, so any
replica behind a load balancer accepts what another served.

A browser re-sends Basic credentials by itself, to any page that asks, so a form on
another site could make a logged-in operator's browser act (CSRF). Every action form
therefore carries a token: an HMAC, under a key derived from the password, of the user,
the action's path and the hour it was issued. Another site cannot read our pages, so it
cannot know the token; the key is the same on every replica, so a form served by one is
accepted by the others; it expires after ``CSRF_LIFETIME``. The ``Origin`` header, which
browsers send with every POST, must also be ours when present.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from ..config.settings import DashboardSettings
from ..errors import ConfigError

CSRF_LIFETIME = 12 * 3600.0  # seconds a form stays usable
REALM = "scheduler-daemon dashboard"


def read_password(settings: DashboardSettings) -> str | None:
    """The configured password (from the file if one is named), or None: no actions."""
    if settings.password is not None:
        return settings.password.get_secret_value()
    if settings.password_file is None:
        return None
    path = Path(settings.password_file)
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"dashboard.password_file: cannot read {path}: {exc}") from None
    if len(text) < 12:
        raise ConfigError(f"dashboard.password_file: {path} must hold at least 12 characters")
    return text


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    @property
    def _csrf_key(self) -> bytes:
        return hashlib.sha256(b"scheduler-daemon csrf\0" + self.password.encode()).digest()

    def identify(self, request: web.Request) -> str | None:
        """The user, if the request carries our Basic credentials; else None."""
        header = request.headers.get("Authorization", "")
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic" or not encoded:
            return None
        try:
            user, sep, password = base64.b64decode(encoded, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        # Both compared in constant time, and both always: no early exit that times apart
        # a wrong user from a wrong password.
        good_user = hmac.compare_digest(user.encode(), self.user.encode())
        good_password = hmac.compare_digest(password.encode(), self.password.encode())
        return user if sep and good_user and good_password else None

    def csrf_token(self, user: str, path: str, now: float | None = None) -> str:
        issued = int((time.time() if now is None else now) // 3600)
        return f"{issued}.{self._mac(user, path, issued)}"

    def csrf_valid(self, token: str, user: str, path: str, now: float | None = None) -> bool:
        issued_text, _, mac = token.partition(".")
        if not issued_text.isdigit() or not mac:
            return False
        issued = int(issued_text)
        hour = int((time.time() if now is None else now) // 3600)
        if not 0 <= hour - issued <= CSRF_LIFETIME // 3600:
            return False
        return hmac.compare_digest(mac, self._mac(user, path, issued))

    def _mac(self, user: str, path: str, issued: int) -> str:
        message = f"{user}\0{path}\0{issued}".encode()
        return hmac.new(self._csrf_key, message, hashlib.sha256).hexdigest()


def challenge() -> web.HTTPUnauthorized:
    return web.HTTPUnauthorized(
        headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
        text="credentials needed (dashboard.user and its password)\n",
    )


def same_origin(request: web.Request) -> bool:
    """A POST from one of our own pages: its ``Origin`` (browsers send one with every
    POST) names this host, or it has none (a script, not a browser). The host alone: a
    reverse proxy that ends TLS makes the scheme differ, never the host."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    return urlsplit(origin).netloc == request.host
