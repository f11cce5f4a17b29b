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


@app.command("chaos")
def chaos(
    fault: Annotated[str, typer.Option(help="a lab fault (`partition-host`, ...) or all")] = "all",
    events: Annotated[int, typer.Option(help="known-id events per fault")] = 10_000,
    rate: Annotated[float, typer.Option(help="events per second")] = 500.0,
    seed: Annotated[int, typer.Option(help="picks the hosts")] = 1,
    work: Annotated[Path, typer.Option(help="the engines' stores and logs")] = Path(
        ".tierflow/lab"
    ),
    report: Annotated[Path, typer.Option(help="the JSON report")] = Path("reports/lab_chaos.json"),
) -> None:
    """A lab of three hosts with the pipeline on it (a Ray job), then each fault under a
    known-id load of Meetup RSVPs from this machine: per fault, every acknowledged event
    stored exactly once, a gateway client's deliveries, the analysis against an exact
    recount, and the time to the next acknowledgement and back to full rate."""
    from cluster.demo.rsvps import RsvpGenerator
    from cluster.lab.chaos import run_fault
    from cluster.lab.cluster import LabCluster
    from cluster.lab.nemesis import KINDS, plan

    why = lab_unavailable()
    if why is not None:
        raise typer.Exit(_fail(why))
    kinds = list(KINDS) if fault == "all" else [fault]
    if any(k not in KINDS for k in kinds):
        raise typer.Exit(_fail(f"unknown fault {fault!r}; known: {', '.join(KINDS)}, all"))
    rows = []
    failed = False
    with Lab.up(3) as lab:
        lc = LabCluster(lab, work.resolve() / lab.plan.lab_id)
        lc.start_engines()
        lc.submit(lc.config())
        try:
            # one for every fault (event times move forward), at the clock's pace
            rsvps = RsvpGenerator(seed=seed, gap_ms=1000.0 / rate)
            for i, f in enumerate(plan(kinds, lab.hosts(), seed)):
                urls, gws = lc.addresses()  # asked again: an actor restarted elsewhere moved
                run = run_fault(
                    lc,
                    f,
                    urls,
                    "meetup",
                    events=events,
                    rate=rate,
                    prefix=f"c{i}",
                    gateways=gws,
                    rsvps=rsvps,
                )
                rows.append({**run.row(), "verdict": "PASS" if run.ok else "FAIL"})
                failed |= not run.ok
                print(json.dumps(rows[-1]))
        finally:
            lc.stop_job()
            lc.close()
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(rows, indent=2))
    if failed:
        raise typer.Exit(1)
