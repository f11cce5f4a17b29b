"""The gateway's web pages: the operations console at `/`, and the views a config adds.

`page_routes(app, views)` serves `actors/access/console/index.html` at `/` and its files at
`/static/<name>`; each `[gateway.views]` entry (name -> a directory of static files, such
as the demo's page `make demo` adds) at `/<name>/` with its files at
`/<name>/static/<file>` (its page names them relatively: `static/app.js`). The pages need
nothing from the internet (no CDN, no build step): they talk only to the gateway that
served them, which the Content-Security-Policy enforces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from aiohttp import web

__all__ = ["CONSOLE_DIR", "page_paths", "page_routes"]

CONSOLE_DIR = Path(__file__).with_name("console")
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


def _served(root: Path) -> dict[str, Path]:
    """The files a page's `static/` may serve: plain files directly in its directory (or
    its `vendor/`), of a known type, by their bare name. Requests are looked up in this
    map, never joined to a path: `{name}` arrives percent-decoded, so `%2Fetc%2Fx.html`
    is an absolute path and `root / name` would be that path, outside the directory."""
    if not root.is_dir():
        return {}
    files = [*root.iterdir(), *((root / "vendor").iterdir() if (root / "vendor").is_dir() else [])]
    return {
        p.name: p
        for p in files
        if p.is_file() and not p.name.startswith(".") and p.suffix in _TYPES
    }


def _page(root: Path) -> tuple[Callable[[web.Request], object], Callable[[web.Request], object]]:
    async def index(request: web.Request) -> web.FileResponse:
        path = root / "index.html"
        if not path.is_file():
            raise web.HTTPNotFound()
        return _file(path)

    async def static(request: web.Request) -> web.FileResponse:
        path = _served(root).get(request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound()
        return _file(path)

    return index, static


def page_paths(views: Mapping[str, str]) -> Callable[[str], bool]:
    """The paths a link from another site may open: the pages and their files, no data."""
    prefixes = tuple(f"/{name}/" for name in views)

    def is_page(path: str) -> bool:
        return (
            path == "/"
            or path.startswith("/static/")
            or path.startswith(prefixes)
            or path.lstrip("/") in views
        )

    return is_page


def page_routes(app: web.Application, views: Mapping[str, str]) -> None:
    """Add the console (`GET /`, `GET /static/{name}`) and each view to `app`.

    Call before the app starts (aiohttp freezes the router then).
    """
    index, static = _page(CONSOLE_DIR)
    app.router.add_get("/", index, name="console")
    app.router.add_get("/static/{name}", static, name="console-static")
    for name, directory in views.items():
        view_index, view_static = _page(Path(directory))

        async def to_slash(request: web.Request, name: str = name) -> web.Response:
            raise web.HTTPFound(f"/{name}/")

        app.router.add_get(f"/{name}", to_slash)
        app.router.add_get(f"/{name}/", view_index)
        app.router.add_get(f"/{name}/static/{{name}}", view_static)
