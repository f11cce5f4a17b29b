"""The live dashboard's static files, for the Gateway to mount on its aiohttp app.

`dashboard_routes(app)` serves `actors/dashboard/index.html` at `/` and the other files at
`/static/<name>`. The page needs nothing from the internet (no CDN, no build step): it talks
only to the gateway that served it, which the Content-Security-Policy enforces.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

__all__ = ["DASHBOARD_DIR", "dashboard_page", "dashboard_routes"]

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


def _served() -> dict[str, Path]:
    """The files `/static/` may serve: plain files directly in the dashboard directory, of
    a known type, by their bare name. Requests are looked up in this map, never joined to
    a path: `{name}` arrives percent-decoded, so `%2Fetc%2Fx.html` is an absolute path and
    `DASHBOARD_DIR / name` would be that path, outside the dashboard directory."""
    return {
        p.name: p
        for p in DASHBOARD_DIR.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix in _TYPES
    }


async def _static(request: web.Request) -> web.FileResponse:
    path = _served().get(request.match_info["name"])
    if path is None:
        raise web.HTTPNotFound()
    return _file(path)


def dashboard_page(path: str) -> bool:
    """The paths a link from another site may open: the page and its files, no data."""
    return path == "/" or path.startswith("/static/")


def dashboard_routes(app: web.Application) -> None:
    """Add `GET /` (the dashboard) and `GET /static/{name}` (its scripts and styles) to `app`.

    Call before the app starts (aiohttp freezes the router then).
    """
    app.router.add_get("/", _index, name="dashboard")
    app.router.add_get("/static/{name}", _static, name="dashboard-static")
