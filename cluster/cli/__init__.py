"""The `tierflow` command line (typer + rich): one module a command group.

- `lifecycle`: ``up``, ``down``, ``demo``: the runtime on this machine.
- `status`: ``status``, ``scale``: reading and resizing it through its admin endpoint.
- `machine`: ``check``, ``certs``, ``config show``, ``nats up``, ``replay``.
- `stores`: ``logger inspect|settle``, ``checkpoint repair``: the actors' LevelDB stores.
- `jobs`: ``jobs list|start|stop``: analysis jobs in the Spark driver actor.
- `chaos`: ``chaos list|run``: the fault-injection suite.
- `history`: ``sql``, ``archive status``: the streams' archive and ad-hoc SQL.
- `lab`: ``lab up|status|down``: a multi-host lab of network namespaces.

`common` holds what they share. Tables go through `cluster.tables`: 80 columns by
default, every column with ``--wide``, the rows with ``--json``. Commands that need Ray
import it when they run, so ``tierflow status`` does not pay for it.
"""

from __future__ import annotations

import typer

from cluster.cli import (
    chaos,
    history,
    jobs,
    lab,
    lifecycle,
    machine,
    nexmark,
    sites,
    status,
    stores,
)

app = typer.Typer(
    help="tierflow: a streaming data pipeline runtime on Ray, NATS and Spark.", no_args_is_help=True
)
app.command()(lifecycle.up)
app.command()(lifecycle.down)
app.command()(status.status)
app.command()(machine.check)
app.command()(status.scale)
app.command()(machine.certs)
app.command()(machine.replay)
app.command()(lifecycle.demo)
app.command()(history.sql)
app.command()(history.audit)
app.add_typer(machine.config_app, name="config")
app.add_typer(machine.nats_app, name="nats")
app.add_typer(stores.checkpoint_app, name="checkpoint")
app.add_typer(stores.logger_app, name="logger")
app.add_typer(jobs.jobs_app, name="jobs")
app.add_typer(nexmark.nexmark_app, name="nexmark")
app.add_typer(chaos.app, name="chaos")
app.add_typer(history.archive_app, name="archive")
app.add_typer(lab.app, name="lab")
app.add_typer(sites.app, name="site")


def main() -> None:
    app()


__all__ = ["app", "main"]
