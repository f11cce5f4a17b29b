"""jobs/archive.py against a real nats-server, Spark and the local filesystem: a stream copied
to Parquet exactly once, across runs, restarts and a batch killed between its files and its
commit."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from jobs.archive import (
    ArchiveSettings,
    archive_dir,
    archive_position,
    expired_partitions,
    purge_archive,
    read_archive,
    start_archive,
)
from runtime.nats.server import NatsEndpoint
from tests.support import with_nats
from tests.test_jetstream_source import add_stream, nats_url, publish, sp

# nats_url and sp are test_jetstream_source's module fixtures, imported so pytest finds them
__all__ = ["nats_url", "sp"]

pytestmark = pytest.mark.timeout(300)

STREAM = "arc"


def payload(i: int) -> bytes:
    if i % 97 == 5:
        return b'{"broken": '  # malformed events are archived too, with valid = false
    return json.dumps({"i": i, "city": f"c{i % 13}", "pad": "x" * (i % 50)}).encode()


def send(url: str, first: int, n: int) -> list[tuple[str, bytes]]:
    msgs = [
        (f"raw.{STREAM}.{'ab'[i % 2]}", payload(i), f"{STREAM}-{i}")
        for i in range(first, first + n)
    ]
    with_nats(lambda nc: publish(nc, msgs), url)
    return [(mid, p) for _, p, mid in msgs]


def digest(data: bytes | str | None) -> str:
    raw = data.encode() if isinstance(data, str) else (data or b"")
    return hashlib.sha256(raw).hexdigest()


def archived(sp: Any, root: Path) -> list[tuple[int, str, str]]:
    """(seq, msg id, payload hash) of every archived event: `data` for a valid event, the
    raw bytes for a malformed one."""
    rows = read_archive(sp, root, STREAM).select("seq", "msg_id", "valid", "data", "raw").collect()
    return sorted((r.seq, r.msg_id, digest(r.data if r.valid else bytes(r.raw))) for r in rows)


def expected(sent: list[tuple[str, bytes]]) -> list[tuple[int, str, str]]:
    return [(i + 1, mid, digest(p)) for i, (mid, p) in enumerate(sent)]


def run_once(
    sp: Any, url: str, settings: ArchiveSettings, ckpt: Path, stream: str = STREAM
) -> None:
    """Archive what the stream holds now (one availableNow run of the archive query)."""
    q = start_archive(sp, stream, NatsEndpoint(url), settings, ckpt, trigger={"availableNow": True})
    q.awaitTermination(240)
    assert q.exception() is None, q.exception()


def test_a_stream_is_archived_once_across_runs_and_a_killed_batch(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    add_stream(nats_url, STREAM, [f"raw.{STREAM}.>"])
    root, ckpt = tmp_path / "archive", tmp_path / "ckpt"
    settings = ArchiveSettings(path=str(root))
    assert archived(sp, root) == [] and archive_position(ckpt, STREAM) is None

    sent = send(nats_url, 0, 3000)
    run_once(sp, nats_url, settings, ckpt)
    assert archived(sp, root) == expected(sent)
    pos = archive_position(ckpt, STREAM)
    assert pos is not None and (pos.next_seq, pos.skipped) == (3001, 0)
    dates = [p.name for p in Path(archive_dir(root, STREAM)).glob("date=*")]
    assert len(dates) >= 1, "partitioned by event date"

    # a second run archives only what is new
    sent += send(nats_url, 3000, 1500)
    run_once(sp, nats_url, settings, ckpt)
    assert archived(sp, root) == expected(sent)
    last = archive_position(ckpt, STREAM)
    assert last is not None and last.next_seq == 4501 and last.batch_id > pos.batch_id

    # The driver dies after the last batch wrote its files but before the sink logged them
    # and Spark committed the batch: its files stay on disk, unlisted. A restart reruns the
    # batch, writing its events again in new files; readers see each event once.
    sink_log = Path(archive_dir(root, STREAM), "_spark_metadata")
    for log_dir in (ckpt / f"archive-{STREAM}" / "commits", sink_log):
        for name in (str(last.batch_id), f".{last.batch_id}.crc"):  # the entry, its checksum
            (log_dir / name).unlink(missing_ok=True)
    files_before = set(Path(archive_dir(root, STREAM)).rglob("*.parquet"))
    run_once(sp, nats_url, settings, ckpt)
    files_after = set(Path(archive_dir(root, STREAM)).rglob("*.parquet"))
    assert files_after > files_before, "the batch was written again"
    assert archived(sp, root) == expected(sent)
    assert archive_position(ckpt, STREAM) == last

    # a partial file of an attempt killed mid-write is not read either
    stray = sorted(files_before)[0]
    shutil.copy(stray, stray.with_name("part-99999-killed-attempt.c000.snappy.parquet"))
    assert archived(sp, root) == expected(sent)


def test_hour_partitioning_and_an_archive_under_a_file_uri(
    sp: Any, nats_url: str, tmp_path: Path
) -> None:
    """The root is any URI Spark's Hadoop layer takes (here file://); hours partition too."""
    url_root = f"file://{tmp_path / 'uri-archive'}"
    settings = ArchiveSettings(path=url_root, partitioning="hour")
    # the module's stream already holds the first test's events (or is made here alone)
    with_nats(lambda nc: _ensure(nc), nats_url)
    total = with_nats(lambda nc: _count(nc), nats_url)
    run_once(sp, nats_url, settings, tmp_path / "ckpt-hour")
    df = read_archive(sp, url_root, STREAM)
    assert df.count() == total
    assert {"date", "hour"} <= set(df.columns)
    hours = list(Path(tmp_path / "uri-archive" / f"stream={STREAM}").glob("date=*/hour=*"))
    assert hours, "partitioned by date and hour"


async def _ensure(nc: Any) -> None:
    from nats.js.api import StreamConfig
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    try:
        await js.stream_info(STREAM)
    except NotFoundError:
        await js.add_stream(StreamConfig(name=STREAM, subjects=[f"raw.{STREAM}.>"]))
        futs = [await js.publish_async(f"raw.{STREAM}.a", payload(i)) for i in range(500)]
        for f in futs:
            await f


async def _count(nc: Any) -> int:
    return int((await nc.jetstream().stream_info(STREAM)).state.messages)


@pytest.mark.unit
def test_expired_partitions_are_whole_days_past_the_retention() -> None:
    now = dt.datetime(2026, 11, 24, 6, 0, tzinfo=dt.UTC)
    names = ["date=2026-11-21", "date=2026-11-22", "date=2026-11-23", "date=2026-11-24"]
    names += ["_spark_metadata", "date=garbage"]
    # 1.5 days back is 2026-11-22 18:00: only the 21st has ended by then
    assert expired_partitions(names, now, 1.5) == ["date=2026-11-21"]
    assert expired_partitions(names, now, 0.25) == [
        "date=2026-11-21",
        "date=2026-11-22",
        "date=2026-11-23",
    ]
    assert expired_partitions(names, now, 30) == []


def test_retention_drops_old_days_and_readers_go_on(sp: Any, nats_url: str, tmp_path: Path) -> None:
    """`retention_days`: the sink runs with Spark's `retention` option, expired day
    partitions are deleted, and the archive still reads (what remains) and still writes."""
    root = tmp_path / "kept"
    settings = ArchiveSettings(path=str(root), retention_days=1)
    with_nats(lambda nc: _ensure(nc), nats_url)
    total = with_nats(lambda nc: _count(nc), nats_url)
    run_once(sp, nats_url, settings, tmp_path / "ckpt-kept")
    assert read_archive(sp, str(root), STREAM).count() == total
    now = dt.datetime.now(dt.UTC)
    assert purge_archive(root, STREAM, 1, now) == []  # today's events are kept
    later = now + dt.timedelta(days=3)
    gone = purge_archive(root, STREAM, 1, later)
    assert gone and not any((root / f"stream={STREAM}" / g).exists() for g in gone)
    assert read_archive(sp, str(root), STREAM).count() == 0  # the log's files are gone
    with_nats(lambda nc: _more(nc, 7), nats_url)
    run_once(sp, nats_url, settings, tmp_path / "ckpt-kept")
    assert read_archive(sp, str(root), STREAM).count() == 7


async def _more(nc: Any, n: int) -> None:
    js = nc.jetstream()
    futs = [await js.publish_async(f"raw.{STREAM}.a", payload(10_000 + i)) for i in range(n)]
    for f in futs:
        await f
