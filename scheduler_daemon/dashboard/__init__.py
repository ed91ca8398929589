"""The browser dashboard, served at ``/`` by every replica's HTTP server (http.py).

- ``views``: the pages, their live fragments (server-sent events) and the actions;
- ``reads``: what the pages show, read from the database and the lock manager;
- ``auth``: who may act (HTTP Basic), and the forms' CSRF tokens;
- ``templates/``, ``static/``: Jinja2 templates, one stylesheet, one small script.
"""

from .views import Dashboard, shows_detail

__all__ = ["Dashboard", "shows_detail"]
