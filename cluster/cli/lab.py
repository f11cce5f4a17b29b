"""`tierflow lab up|status|down`: a multi-host lab of network namespaces on this machine
(cluster/lab), kept until `lab down`; with `--engines`, a NATS node and a Ray node on each
host. Needs root."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cluster.lab.hosts import RECORDS, Lab, LabError, lab_on_record, lab_unavailable, labs_on_record

app = typer.Typer(help="A multi-host lab of network namespaces on this machine.")


@app.command("up")
def up(
    hosts: Annotated[int, typer.Option(help="how many hosts")] = 3,
    engines: Annotated[bool, typer.Option(help="a NATS node and a Ray node on each host")] = False,
    work: Annotated[Path, typer.Option(help="the engines' stores and logs")] = Path(
        ".tierflow/lab"
    ),
) -> None:
    """Make a lab (cleaning up labs whose runs are gone first) and print its hosts."""
    why = lab_unavailable()
    if why is not None:
        raise typer.Exit(_fail(why))
    lab = Lab.up(hosts, keep=True)
    if engines:
        from cluster.lab.cluster import LabCluster

        lc = LabCluster(lab, work.resolve() / lab.plan.lab_id)
        try:
            lc.start_engines()
        except (LabError, OSError) as err:
            lab.down()
            raise typer.Exit(_fail(f"engines did not start: {err}")) from None
        print(
            json.dumps({**lab.status(), "nats_url": lc.nats_url, "ray": lc.ray and lc.ray.address})
        )
        return
    print(json.dumps(lab.status()))


@app.command("status")
def status() -> None:
    """Every lab on record: its hosts, their addresses and the processes in them."""
    out = {}
    for lab_id, rec in labs_on_record(RECORDS).items():
        out[lab_id] = {**lab_on_record(lab_id).status(), "kept": rec.owner_pid == 0}
    print(json.dumps(out, indent=2))


@app.command("down")
def down(
    lab_id: Annotated[str, typer.Argument(help="the lab's id (`lab status`); all if omitted")] = "",
) -> None:
    """Stop every process in the lab's hosts, delete its namespaces and bridges."""
    ids = [lab_id] if lab_id else list(labs_on_record(RECORDS))
    for one in ids:
        try:
            lab_on_record(one).down()
        except LabError as err:
            raise typer.Exit(_fail(str(err))) from None
        print(f"lab {one}: down")


def _fail(why: str) -> int:
    typer.echo(f"lab: {why}", err=True)
    return 1
