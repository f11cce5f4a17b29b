"""The live dashboard's static files, for the Gateway to mount on its aiohttp app.

`dashboard_routes(app)` serves `actors/dashboard/index.html` at `/` and the other files at
`/static/<name>`. The page needs nothing from the internet (no CDN, no build step): it talks
only to the gateway that served it, which the Content-Security-Policy enforces.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

__all__ = ["DASHBOARD_DIR", "dashboard_routes"]

DASHBOARD_DIR = Path(__file__).with_name("dashboard")
# 'self' covers same-origin ws:// and wss:// in current browsers; listed anyway for older ones.
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self' ws: wss:; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
)
_HEADERS = {
    "Content-Security-Policy": _CSP,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


def _file(path: Path) -> web.FileResponse:
    return web.FileResponse(path, headers={**_HEADERS, "Content-Type": _TYPES[path.suffix]})


async def _index(request: web.Request) -> web.FileResponse:
    return _file(DASHBOARD_DIR / "index.html")


async def _static(request: web.Request) -> web.FileResponse:
    """Only plain files directly in the dashboard directory, of a known type (no traversal:
    the route's `{name}` never contains a slash)."""
    name = request.match_info["name"]
    path = DASHBOARD_DIR / name
    if name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
        raise web.HTTPNotFound()
    return _file(path)


def dashboard_routes(app: web.Application) -> None:
    """Add `GET /` (the dashboard) and `GET /static/{name}` (its scripts and styles) to `app`.

    Call before the app starts (aiohttp freezes the router then).
    """
    app.router.add_get("/", _index, name="dashboard")
    app.router.add_get("/static/{name}", _static, name="dashboard-static")
