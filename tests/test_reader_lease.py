"""Readers of an archived stream's history hold retention back while they read
(jobs/read_lease.py, jobs/sql.py `stream_events`), and a reader that meets a gap anyway
fails loudly (HistoryGap) instead of answering short.

The leases alone first (files, a clock passed in); then real NATS and Spark: an archived
stream with a small `max_bytes` and a short `max_age_s` under steady load, its archive
flushing every second, retention passes (the driver's own, jobs/retention_holds.py `trim`)
running back to back, and readers whose NATS connection goes through a fault proxy that
delays every chunk, so that the archive commits and retention purges many times between
a reader's look at the archive's position and its read of the tail: the timing the gap
needs, made certain rather than hoped for. Every `SELECT count(*)` and every `jobs
recompute` must equal the exact count or fail with HistoryGap, never come out short.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest

from cluster.chaos.proxy import Latency, ProxyThread
from jobs.archive import ArchiveSettings, archive_position, start_archive
from jobs.copies import acurrent_copy
from jobs.read_lease import READERS_DIR, HistoryGap, Lease, ReadLease, live_floor, read_leases
from jobs.recompute import recompute
from jobs.retention_holds import reader_holds, trim
from jobs.sql import StreamTable, run_sql
from runtime.config import validate
from runtime.engines.services import ensure_streams
from runtime.job_specs import decode_spec
from runtime.nats.server import NatsEndpoint
from runtime.waiting import wait_until
from tests.support import BackgroundLoad, with_nats
from tests.test_jetstream_source import nats_url, sp

# nats_url and sp are test_jetstream_source's module fixtures, imported so pytest finds them
__all__ = ["nats_url", "sp"]

pytestmark = pytest.mark.timeout(600)

STREAM, SUBJECT = "leased", "raw.leased"
MAX_BYTES = 300_000
FLUSH_S = 1.0

# ---- the leases -------------------------------------------------------------------------


@pytest.mark.unit
def test_the_lowest_unexpired_lease_holds() -> None:
    a, b = Lease("a", STREAM, 50, expires=100.0), Lease("b", STREAM, 20, expires=10.0)
    assert live_floor([a, b], now=5.0) == b
    assert live_floor([a, b], now=50.0) == a  # b lapsed: its reader stopped renewing
    assert live_floor([a, b], now=200.0) is None


@pytest.mark.unit
def test_a_lease_holds_from_zero_moves_renews_and_goes(tmp_path: Path) -> None:
    now = [1_000.0]
    with ReadLease(tmp_path, STREAM, "sql", ttl_s=30, clock=lambda: now[0]) as lease:
        held = read_leases(tmp_path, STREAM, now[0])
        assert [(x.next_seq, x.expires, x.reader) for x in held] == [(0, 1_030.0, "sql")]
        assert [h.next_seq for h in reader_holds(tmp_path, STREAM, now[0])] == [0]
        now[0] = 1_020.0
        lease.move(77)  # every write renews
        (held,) = read_leases(tmp_path, STREAM, now[0])
        assert (held.next_seq, held.expires) == (77, 1_050.0)
        assert reader_holds(tmp_path, STREAM, 1_051.0) == []  # lapsed without renewal
    assert read_leases(tmp_path, STREAM, now[0]) == []  # released


@pytest.mark.unit
def test_a_lease_is_renewed_while_held(tmp_path: Path) -> None:
    with ReadLease(tmp_path, STREAM, ttl_s=0.3) as lease:
        lease.move(5)
        first = read_leases(tmp_path, STREAM)[0].expires
        assert wait_until(lambda: read_leases(tmp_path, STREAM)[0].expires > first, 10, 0.02)


@pytest.mark.unit
def test_long_expired_and_foreign_lease_files(tmp_path: Path) -> None:
    folder = tmp_path / READERS_DIR / STREAM
    folder.mkdir(parents=True)
    (folder / "old.json").write_text(json.dumps({"from": 3, "expires": 10.0}))
    (folder / "junk.json").write_text("not json")
    (folder / "live.json").write_text(json.dumps({"from": 9, "expires": 5_000.0}))
    assert [x.id for x in read_leases(tmp_path, STREAM, now=4_000.0)] == ["live"]
    assert not (folder / "old.json").exists()  # expired long ago: forgotten


@pytest.mark.unit
def test_an_unwritable_root_reads_unprotected_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING), ReadLease(blocker, STREAM) as lease:
        lease.move(4)
        assert not lease.held
    assert "without holding retention back" in caplog.text


@pytest.mark.unit
def test_a_gap_names_the_missing_range() -> None:
    text = str(HistoryGap(STREAM, 120, 180))
    assert "sequences 120..179 were purged" in text and "run it again" in text


# ---- real NATS and Spark ----------------------------------------------------------------


def _cfg(tmp: Path) -> Any:
    body = {
        "subjects": [SUBJECT],
        "max_age_s": 1,
        "max_bytes": MAX_BYTES,
        "archive": {"flush_s": FLUSH_S},
        "schema": "k string, i long",
    }
    return validate({"state_dir": str(tmp), "streams": {STREAM: body}})


class _Load(BackgroundLoad):
    """About 300 events a second, each retried until the stream takes it (a full stream
    refuses: the bridge's retry, in short), so sequences have no gaps."""

    published = 0

    async def main(self, nc: Any) -> None:
        js = nc.jetstream()
        while not self.stopping:
            for _ in range(30):
                i = self.published
                body = json.dumps({"k": f"k{i % 7}", "i": i}).encode()
                for _try in range(600):
                    try:
                        await js.publish(SUBJECT, body, headers={"Nats-Msg-Id": f"e{i}"})
                        break
                    except nats.js.errors.APIError:  # full: wait for retention
                        await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"event {i} refused for 30 s")
                self.published += 1
            await asyncio.sleep(0.1)


class _Retention(BackgroundLoad):
    """The driver's retention pass over the stream, back to back (every 0.2 s instead of
    10 s): the pressure."""

    def __init__(self, url: str, cfg: Any, root: Path) -> None:
        super().__init__(url)
        self.cfg, self.root = cfg, root
        self.purged = 0

    async def main(self, nc: Any) -> None:
        s = self.cfg.streams[STREAM]

        def archived() -> int:
            pos = archive_position(self.root, STREAM)
            return pos.next_seq if pos else 1

        while not self.stopping:
            here = await acurrent_copy(nc, STREAM)
            self.purged += (await trim(nc, STREAM, s, self.root, here, archived)).purged
            await asyncio.sleep(0.2)


def _last_seq(url: str) -> int:
    async def go(nc: Any) -> int:
        return int((await nc.jetstream().stream_info(STREAM)).state.last_seq)

    return with_nats(go, url)


def _answers(sp: Any, url: str, slow: NatsEndpoint, table: StreamTable, rounds: int) -> list:
    """(kind, exact count, answer or HistoryGap) of `rounds` SQL counts and recomputes."""
    spec = decode_spec({"name": "c", "kind": "count", "stream": STREAM, "by": ["k"]})
    out: list[tuple[str, int, int | HistoryGap]] = []
    for _ in range(rounds):
        high = _last_seq(url)
        query = f"SELECT count(*) AS n FROM {STREAM} WHERE _seq <= {high}"
        try:
            got: int | HistoryGap = run_sql(sp, slow, query, {STREAM: table}).rows[0][0]
        except HistoryGap as gap:
            got = gap
        out.append(("sql", high, got))
        high = _last_seq(url)
        try:
            got = sum(recompute(sp, slow, spec, table, high_water=high).counts.values())
        except HistoryGap as gap:
            got = gap
        out.append(("recompute", high, got))
    return out


def _short(answers: list) -> list:
    return [
        (kind, high, got) for kind, high, got in answers if isinstance(got, int) and got != high
    ]


def test_history_reads_under_retention_pressure_are_exact_or_fail_loudly(
    sp: Any, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(tmp_path)
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    root, path = tmp_path / "spark", tmp_path / "archive"
    endpoint = NatsEndpoint(nats_url)
    load = _Load(nats_url).start()
    archive = start_archive(sp, STREAM, endpoint, ArchiveSettings(str(path), flush_s=FLUSH_S), root)
    retention = _Retention(nats_url, cfg, root).start()
    host, port = nats_url.rsplit("/", 1)[-1].split(":")
    proxy = ProxyThread(host, int(port), seed=34)
    proxy.start()
    try:
        proxy.add(Latency(ms=300))  # each chunk to and from the readers' NATS: 0.3 s late
        slow = NatsEndpoint(f"nats://127.0.0.1:{proxy.port}")
        schema = cfg.streams[STREAM].schema
        table = StreamTable(
            STREAM, archive_root=str(path), checkpoint_root=str(root), schema=schema
        )
        # pressure on: archived, and purged from the stream
        assert wait_until(lambda: retention.purged > 0, 120, 0.2), "retention never purged"
        held = _answers(sp, nats_url, slow, table, 2)
        first_purged = retention.purged
        # a retention that does not see the leases (one from before them, an operator's
        # purge): the readers meet the gap, and must say so rather than answer short
        monkeypatch.setattr("jobs.retention_holds.reader_holds", lambda *a, **k: [])
        unheld = _answers(sp, nats_url, slow, table, 1)
    finally:
        proxy.stop()
        retention.join()
        archive.stop()
        load.join()
    assert not _short(held), f"short answers (kind, exact, answered): {_short(held)}"
    assert all(got == high for _, high, got in held), held  # held back: every one exact
    assert not _short(unheld), f"short answers (kind, exact, answered): {_short(unheld)}"
    gaps = [got for _, _, got in unheld if isinstance(got, HistoryGap)]
    assert gaps, f"no reader met a purge without its lease: the pressure was not on ({unheld})"
    assert all(g.stream == STREAM and g.first > g.start for g in gaps)
    assert retention.purged > first_purged  # purges went on while the readers read
    assert read_leases(root, STREAM) == []  # every reader let go
