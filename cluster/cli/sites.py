"""`tierflow site status|promote`: the sites of geo replication (docs/geo.md).

`promote SITE` is the failover command: it makes sure SITE's copies of the replicated
streams exist and source the other sites (creating them if SITE never had them), checks
each one answers, records SITE as the active site in sites.json, and prints the URL to
point producers and the runtime at. The decision is cluster/failover.py's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from cluster.cli.common import ConfigOpt, JsonOpt, WideOpt, console, err_console, load_config
from cluster.cli.status import REPLICATION_COLUMNS, replication_rows
from cluster.failover import Promotion, plan_promotion, site_url
from cluster.tables import build, print_tables
from runtime.config import Config
from runtime.engines.services import connect_nats, ensure_streams, nats_store_dir
from runtime.geo.replication import replication_lag
from runtime.geo.sites import SITES_FILE

app = typer.Typer(help="Sites of geo replication: lag and failover.", no_args_is_help=True)

SitesFileOpt = Annotated[
    Path | None,
    typer.Option("--sites-file", help="sites.json of `nats up --sites` (default: under the store)"),
]
UrlOpt = Annotated[str, typer.Option("--url", help="the site's client URLs (comma-joined)")]


def sites_file(cfg: Config, given: Path | None) -> Path:
    return given or nats_store_dir(cfg) / "sites" / SITES_FILE


def read_sites(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


async def promote_site(cfg: Config, site: str, url: str) -> Promotion:
    """Ensure SITE's copies (through SITE itself: the lost site is skipped), then judge."""
    if not url:
        return plan_promotion(cfg, site, url, [])
    cfg = msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, url=url))
    nc = await connect_nats(cfg, url=url, name="tierflow-site-promote")
    try:
        here = (await nc.jetstream(timeout=2).account_info()).domain
        if here and here != site:
            return Promotion(site, url, problems=[f"{url} is site {here}, not {site}"])
        await ensure_streams(nc, cfg)
        rows = await replication_lag(nc, cfg)
    finally:
        await nc.close()
    return plan_promotion(cfg, site, url, rows)


@app.command()
def promote(
    site: Annotated[str, typer.Argument(help="the site to serve from, e.g. site-b")],
    config: ConfigOpt = None,
    url: UrlOpt = "",
    sites: SitesFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Fail over to SITE: its copies serve from now on (exit 1 if one does not answer)."""
    cfg = load_config(config)
    path = sites_file(cfg, sites)
    state = read_sites(path)
    target = url or site_url(state, site)
    result = asyncio.run(promote_site(cfg, site, target))
    if result.ok and state:
        path.write_text(json.dumps({**state, "active": site}, indent=2))
    if as_json:
        print(json.dumps({**result.__dict__, "ok": result.ok}))
    else:
        for p in result.problems:
            err_console.print(f"[red]{p}[/red]")
        for n in result.notes:
            console.print(n)
        if result.ok:
            console.print(f"[green]{site} promoted[/green]: {', '.join(result.streams)}")
    if not result.ok:
        raise typer.Exit(1)


@app.command("status")
def status_(
    config: ConfigOpt = None,
    url: UrlOpt = "",
    sites: SitesFileOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Each replicated stream's copies and their lag behind every other site."""
    cfg = load_config(config)
    state = read_sites(sites_file(cfg, sites))
    names = [s["name"] for s in state.get("sites") or []]
    active = state.get("active") or (names[0] if names else "")
    target = url or cfg.nats.url or site_url(state, active)
    if not target:
        err_console.print("no site to ask: pass --url or run `tierflow nats up --sites N`")
        raise typer.Exit(2)

    async def rows() -> list[dict[str, Any]]:
        nc = await connect_nats(cfg, url=target, name="tierflow-site-status")
        try:
            return await replication_lag(nc, cfg)
        finally:
            await nc.close()

    snap = {"replication": asyncio.run(rows())}
    if as_json:
        print(json.dumps(snap["replication"]))
        return
    table = replication_rows(snap)
    print_tables(
        lambda w: [build(REPLICATION_COLUMNS, table, wide=wide, width=w, title="geo")], wide=wide
    )


__all__ = ["app", "promote_site"]
