"""The driver's dead-letter scan (jobs/deadletter_scan.py) against a real nats-server: a
stranger's stream name, malformed events among valid ones read in several passes, a pass
resent after a crash, events aged out before the scan, a missing stream; and where a scan
starts after the Spark dead-letter query it replaces (jobs.deadletter_book.deadletter_position)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from jobs.deadletter_book import DeadLetterCount, deadletter_position
from jobs.deadletter_scan import DeadLetterScan, next_range
from jobs.jetstream_options import SeqRange
from jobs.sink import SOURCE_SEQ_HEADER, BatchReport
from runtime.nats.endpoint import NatsEndpoint
from runtime.nats.publisher import MSG_ID_HEADER
from runtime.waiting import wait_until
from tests.support import NatsFactory, with_nats
from tests.test_sink import add_stream, stream_msgs

pytestmark = pytest.mark.timeout(120)

BAD = (b"\xff\xfe not utf-8", b'{"order": ', b"", b"[1, 2")


@pytest.mark.unit
def test_a_pass_starts_at_the_position_or_the_first_retained_and_is_bounded() -> None:
    assert next_range(0, 0, 1, 100) == SeqRange(1, 1)  # a new stream: nothing to read
    assert next_range(0, 1, 11, 100) == SeqRange(1, 11)
    assert next_range(5, 1, 11, 3) == SeqRange(5, 8)  # a backlog, in bounded steps
    assert next_range(11, 1, 11, 3) == SeqRange(11, 11)  # caught up
    assert next_range(2, 7, 11, 100) == SeqRange(7, 11)  # 2..6 aged out or compacted


@pytest.mark.unit
def test_the_scan_starts_where_its_record_or_the_replaced_spark_query_ended(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "deadletter_orders"
    assert deadletter_position(None, ckpt) == 0  # nothing yet: the stream's first
    (ckpt / "offsets").mkdir(parents=True)
    (ckpt / "commits").mkdir()
    for batch, seq in ((6, 120), (7, 150)):  # Spark's offset log: version, metadata, offset
        (ckpt / "offsets" / str(batch)).write_text(f'v1\n{{}}\n{{"seq": {seq}}}\n')
    (ckpt / "commits" / "6").write_text("v1\n{}\n")  # batch 7 ran, its commit never came
    legacy = DeadLetterCount(last_batch=6, total=3)  # the Spark query's record: no position
    assert deadletter_position(legacy, ckpt) == 120  # batch 7 is read again
    assert deadletter_position(None, ckpt) == 120
    assert deadletter_position(DeadLetterCount(6, 3, next_seq=400), ckpt) == 400


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    server = nats_factory()
    add_stream(server.url, "deadletter", ["deadletter.>"])
    return server.url


def publish(url: str, stream_subject: str, payloads: list[bytes]) -> list[int]:
    async def go(nc: Client) -> list[int]:
        js = nc.jetstream()
        return [(await js.publish(stream_subject, p)).seq for p in payloads]

    return with_nats(go, url)


def mixed(n: int) -> tuple[list[bytes], list[int]]:
    """`n` events, every fifth malformed; the 0-based indexes of the malformed."""
    out, bad = [], []
    for i in range(n):
        if i % 5 == 3:
            out.append(BAD[len(bad) % len(BAD)])
            bad.append(i)
        else:
            out.append(json.dumps({"order": i, "note": "ü"}).encode())
    return out, bad


class Recorder:
    """The driver's side of a scan: positions and the count of newly stored dead letters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.position = 0
        self.total = 0
        self.passes: list[tuple[int, BatchReport]] = []

    def __call__(self, next_seq: int, report: BatchReport) -> None:
        with self.lock:
            self.position = next_seq
            self.total += report.published - report.duplicates
            self.passes.append((next_seq, report))


def dead_letters(url: str, stream: str) -> list[tuple[str, str]]:
    return [
        (h[MSG_ID_HEADER], h[SOURCE_SEQ_HEADER])
        for _, h, _ in stream_msgs(url, "deadletter", f"deadletter.{stream}")
    ]


def run_scan(url: str, stream: str, position: int, rec: Recorder, **kw: Any) -> DeadLetterScan:
    return DeadLetterScan(NatsEndpoint(url), stream, position, rec, every_s=0.1, **kw).start()


def test_malformed_events_are_dead_lettered_once_across_passes_and_a_resent_pass(
    nats_url: str,
) -> None:
    add_stream(nats_url, "orders_eu", ["shop.orders.>"])
    payloads, bad = mixed(53)
    seqs = publish(nats_url, "shop.orders.new", payloads)
    want = [(f"dl:orders_eu:{seqs[i]}", str(seqs[i])) for i in bad]
    rec = Recorder()
    scan = run_scan(nats_url, "orders_eu", 0, rec, max_events=7)
    try:
        wait_until(lambda: rec.position == seqs[-1] + 1, 60, what="the scan caught up")
        assert scan.isActive and scan.exception() is None
    finally:
        scan.stop()
    assert dead_letters(nats_url, "orders_eu") == want
    assert rec.total == len(bad)
    assert len(rec.passes) >= 8  # 53 events, at most 7 a pass
    assert all(b - a <= 7 for (a, _), (b, _) in zip(rec.passes, rec.passes[1:], strict=False))
    assert scan.lastProgress is not None and scan.recentProgress[-1] is scan.lastProgress

    # a crash before the last positions were recorded: the same passes are sent again
    again = Recorder()
    scan = run_scan(nats_url, "orders_eu", seqs[20], again)
    try:
        wait_until(lambda: again.position == seqs[-1] + 1, 60, what="the resent passes")
    finally:
        scan.stop()
    resent = sum(r.published for _, r in again.passes)
    assert resent == sum(1 for i in bad if i >= 20) and again.total == 0  # all duplicates
    assert dead_letters(nats_url, "orders_eu") == want  # still each once

    # new events after the scan stopped: the next scan goes on from its position
    more, more_bad = mixed(9)
    more_seqs = publish(nats_url, "shop.orders.late", more)
    scan = run_scan(nats_url, "orders_eu", rec.position, rec)
    try:
        wait_until(lambda: rec.position == more_seqs[-1] + 1, 60, what="the new events")
    finally:
        scan.stop()
    assert rec.total == len(bad) + len(more_bad)
    late = [(f"dl:orders_eu:{more_seqs[i]}", str(more_seqs[i])) for i in more_bad]
    assert dead_letters(nats_url, "orders_eu") == want + late


def test_events_aged_out_before_the_scan_are_passed_over(nats_url: str) -> None:
    async def limited(nc: Client) -> None:
        from nats.js.api import StreamConfig

        await nc.jetstream().add_stream(StreamConfig(name="clicks", subjects=["clk"], max_msgs=6))

    with_nats(limited, nats_url)
    payloads, bad = mixed(20)  # malformed at 3, 8, 13, 18; the stream keeps the last 6
    seqs = publish(nats_url, "clk", payloads)
    rec = Recorder()
    scan = run_scan(nats_url, "clicks", 0, rec)
    try:
        wait_until(lambda: rec.position == seqs[-1] + 1, 60, what="the scan caught up")
    finally:
        scan.stop()
    assert dead_letters(nats_url, "clicks") == [(f"dl:clicks:{seqs[18]}", str(seqs[18]))]
    assert rec.total == 1 and bad[-1] == 18


def test_a_scan_of_a_missing_stream_ends_with_an_error_naming_it(nats_url: str) -> None:
    rec = Recorder()
    scan = run_scan(nats_url, "no_such_stream", 0, rec)
    try:
        wait_until(lambda: not scan.isActive, 30, what="the scan ended")
    finally:
        scan.stop()
    assert "no_such_stream" in str(scan.exception())
    assert rec.passes == []
