"""`make chaos`: every lab fault under a known-id load of Meetup RSVPs on the pipeline
spread over three hosts (cluster/lab/chaos.py), each judged: every acknowledged event
stored exactly once, a gateway client on the laptop got each stored match once, and the
analysis's answers equal an exact recount of the stream.
What each fault cost the writers (to the next acknowledgement, back to full rate) is
printed and written to reports/lab_chaos.json; a speed is reported, never asserted.

`TFLAB_EVENTS` (default 100,000) and `TFLAB_RATE` (events/s, default 1,000)
size each fault's load. `make test` runs the short form, tests/test_lab_pipeline.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.demo.rsvps import RsvpGenerator
from cluster.lab.chaos import StreamBook, run_fault
from cluster.lab.cluster import LabCluster, pipeline_lab
from cluster.lab.hosts import lab_unavailable
from cluster.lab.nemesis import (
    BRIDGE_PARTITION,
    FLAKY_LINK,
    HOST_CRASH,
    HOST_PAUSE,
    PARTITION_HOST,
    PARTITION_MINORITY,
    LabFault,
    plan,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(3600)]

EVENTS = int(os.environ.get("TFLAB_EVENTS", "100000"))
RATE = float(os.environ.get("TFLAB_RATE", "1000"))
SEED = 1
STREAM = "meetup"
REPORT = Path("reports/lab_chaos.json")
# one partition per role mix, then each other fault on a host the seed picks
ROLE_MIXES = ("logger-primary", "nats-leader", "ray-head", "spark-driver", "collector-0")
CASES: list[LabFault] = [
    *(LabFault(0.3, PARTITION_HOST, (f"role:{role}",), 30.0) for role in ROLE_MIXES),
    *plan(
        [PARTITION_MINORITY, BRIDGE_PARTITION, HOST_CRASH, HOST_PAUSE, FLAKY_LINK],
        ["h1", "h2", "h3"],
        SEED,
    ),
]
ROWS: list[dict[str, Any]] = []
# one for the suite (event times only move forward), at the clock's pace: a fault that
# holds an event back d seconds makes it d seconds late, within the lab's watermark
RSVPS = RsvpGenerator(seed=SEED, gap_ms=1000.0 / RATE)


@pytest.fixture(scope="module")
def lab_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LabCluster]:
    if "chaos" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the lab's faults at full size run with -m chaos (make chaos)")
    why = lab_unavailable()
    if why is not None:
        pytest.skip(why)
    with pipeline_lab(tmp_path_factory.mktemp("labchaos")) as lc:
        try:
            try:
                lc.addresses()
            except Exception:
                print(lc.job_logs())
                raise
            yield lc
        finally:
            REPORT.parent.mkdir(exist_ok=True)
            REPORT.write_text(json.dumps(ROWS, indent=2))


@pytest.fixture(scope="module")
def book(lab_cluster: LabCluster) -> StreamBook:
    """The stream's ids and recount, carried across the faults (each reads only its own)."""
    return StreamBook(STREAM)


@pytest.mark.parametrize("fault", CASES, ids=[f"{f.kind}-{f.hosts[0]}" for f in CASES])
def test_a_lab_fault_loses_and_duplicates_nothing_acknowledged(
    lab_cluster: LabCluster, book: StreamBook, fault: LabFault
) -> None:
    lc = lab_cluster
    urls, gateways = lc.addresses()  # asked again: an actor restarted elsewhere moved
    prefix = f"{fault.kind}-{fault.hosts[0].replace(':', '-')}"
    run = run_fault(
        lc,
        fault,
        urls,
        STREAM,
        events=EVENTS,
        rate=RATE,
        prefix=prefix,
        gateways=gateways,
        rsvps=RSVPS,
        book=book,
    )
    ROWS.append(run.row())
    print(f"\nlab chaos: {run.row()}")
    assert run.acknowledged == EVENTS, run.row()
    assert run.verdict.ok, str(run.verdict)
    assert run.delivery is not None and run.delivery.ok, run.row()  # the client: each once
    assert run.analysis == [], run.row()  # the answers: an exact recount of the stream
