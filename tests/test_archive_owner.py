"""One archive directory, one writer: two sites sharing an archive root each archive their own
copy in a directory of its own, and a writer whose checkpoint does not own the directory it
finds is refused at start (jobs/archive.py), in the driver too, which then purges nothing
of that stream.

Real parts: nats-servers (two with JetStream domains standing for two sites), Spark
local[2] running the archive query, the local filesystem; the driver test adds a local Ray
and the AnalysisDriver actor.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import ray

from jobs.archive import (
    OWNER_FILE,
    ArchiveOwnerError,
    ArchiveSettings,
    HadoopFs,
    archive_dir,
    archive_position,
    archive_query_name,
    claim_archive,
    copy_root,
    queries_root,
    read_archive,
    start_archive,
)
from jobs.copies import CopyId, current_copy
from jobs.sql import StreamTable, stream_events
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsEndpoint
from runtime.waiting import wait_until
from tests.support import running_driver, with_nats
from tests.test_jetstream_source import add_stream, publish, sp

__all__ = ["sp"]  # test_jetstream_source's module fixture (Spark with the jetstream source)

pytestmark = pytest.mark.timeout(600)

STREAM = "orders"


def send(url: str, prefix: str, first: int, n: int, stream: str = STREAM) -> list[str]:
    """`n` events with ids `<prefix>-<i>`, acknowledged; returns the ids."""
    ids = [f"{prefix}-{i}" for i in range(first, first + n)]
    msgs = [(f"raw.{stream}.x", json.dumps({"i": i}).encode(), mid) for i, mid in enumerate(ids)]
    with_nats(lambda nc: publish(nc, msgs), url)
    return ids


def run_once(sp: Any, url: str, root: Path | str, ckpt: Path, stream: str = STREAM) -> None:
    """Archive what the stream holds now (one availableNow run), as the driver would."""
    settings = ArchiveSettings(path=str(root))
    q = start_archive(sp, stream, NatsEndpoint(url), settings, ckpt, trigger={"availableNow": True})
    q.awaitTermination(240)
    assert q.exception() is None, q.exception()


def ids_in(df: Any) -> Counter[str]:
    return Counter(r.msg_id for r in df.select("msg_id").collect())


def test_two_sites_sharing_one_archive_root_each_archive_their_own_copy_once(
    sp: Any, nats_factory: Any, tmp_path: Path
) -> None:
    """Same config on two sites, one `archive.path`: each site's archive holds every event of
    its own copy exactly once, in a directory of its own, and so does each site's history
    once the stream is purged below the archive's position (as retention does)."""
    urls = {
        site: nats_factory(js_domain=site, sync_interval="2m").url for site in ("site-a", "site-b")
    }
    for url in urls.values():
        add_stream(url, STREAM, [f"raw.{STREAM}.>"])
    shared = tmp_path / "shared-archive"
    ckpts = {site: tmp_path / f"ckpt-{site}" for site in urls}
    sent: dict[str, list[str]] = {site: [] for site in urls}
    # interleaved runs: each writer commits batches 0 and 1 of its own checkpoint
    for site, n in (("site-a", 300), ("site-b", 200), ("site-a", 150), ("site-b", 250)):
        sent[site] += send(urls[site], site, len(sent[site]), n)
        run_once(sp, urls[site], shared, ckpts[site])

    copies = {site: current_copy(NatsEndpoint(url), STREAM) for site, url in urls.items()}
    got = {
        site: ids_in(read_archive(sp, copy_root(shared, c), STREAM)) for site, c in copies.items()
    }
    for site in urls:
        assert copies[site].domain == site
        assert got[site] == Counter(sent[site]), (site, sum(got[site].values()), len(sent[site]))
    dirs = {}
    for site, copy in copies.items():
        dirs[site] = archive_dir(copy_root(shared, copy), STREAM)
        owner = json.loads(Path(dirs[site], OWNER_FILE).read_text())
        assert owner["copy"]["domain"] == site and owner["checkpoint"].startswith(str(ckpts[site]))
    assert dirs["site-a"] != dirs["site-b"]
    assert all(d.startswith(str(shared)) for d in dirs.values())

    # retention purges each copy below its archive's position: the history stays whole
    for site, url in urls.items():
        pos = archive_position(ckpts[site], STREAM)
        assert pos is not None and pos.next_seq == len(sent[site]) + 1
        with_nats(lambda nc, s=pos.next_seq: nc.jetstream().purge_stream(STREAM, seq=s), url)
        copy = current_copy(NatsEndpoint(url), STREAM)
        table = StreamTable(STREAM, copy_root(shared, copy), str(ckpts[site]))
        events = stream_events(sp, NatsEndpoint(url), table)
        assert ids_in(events) == Counter(sent[site]), site


@pytest.fixture(scope="module")
def plain_url(nats_factory: Any) -> str:
    """A site without a JetStream domain (a single-site deployment)."""
    url = nats_factory(sync_interval="2m").url
    add_stream(url, STREAM, [f"raw.{STREAM}.>"])
    return url


def test_a_writer_whose_checkpoint_does_not_own_the_directory_is_refused(
    sp: Any, plain_url: str, tmp_path: Path
) -> None:
    """A second checkpoint on a directory another writer owns is refused before it writes,
    naming the directory and its owner; an archive from before owner records (no owner
    file) is adopted by the checkpoint whose batches its log lists, and refused to another."""
    root = tmp_path / "archive"
    first, second = tmp_path / "ckpt-first", tmp_path / "ckpt-second"
    sent = send(plain_url, "one", 0, 400)
    run_once(sp, plain_url, root, first)
    directory = archive_dir(root, STREAM)  # a site without a domain: the root itself

    with pytest.raises(ArchiveOwnerError) as refused:
        run_once(sp, plain_url, root, second)
    assert Path(directory, OWNER_FILE).is_file()
    why = str(refused.value)
    assert directory in why and str(first / archive_query_name(STREAM)) in why, why
    assert str(second / archive_query_name(STREAM)) in why, why
    assert archive_position(second, STREAM) is None, "the refused writer committed nothing"

    # an archive written before owner records: its own checkpoint adopts it and goes on
    Path(directory, OWNER_FILE).unlink()
    sent += send(plain_url, "one", 400, 100)
    run_once(sp, plain_url, root, first)
    owner = json.loads(Path(directory, OWNER_FILE).read_text())
    assert owner["checkpoint"] == str(first / archive_query_name(STREAM))
    assert ids_in(read_archive(sp, root, STREAM)) == Counter(sent)

    # ... and another checkpoint, whose batches its log does not list, is refused
    Path(directory, OWNER_FILE).unlink()
    with pytest.raises(ArchiveOwnerError, match="_spark_metadata"):
        run_once(sp, plain_url, root, tmp_path / "ckpt-third")
    assert not Path(directory, OWNER_FILE).exists()
    assert ids_in(read_archive(sp, root, STREAM)) == Counter(sent)


@pytest.mark.unit
def test_a_site_with_a_domain_has_a_directory_of_its_own() -> None:
    a = CopyId(domain="site-a", stream=STREAM, created="1")
    plain = CopyId(domain="", stream=STREAM, created="1")
    assert copy_root("s3a://bucket/tf/", a) == "s3a://bucket/tf/site=site-a"
    assert archive_dir(copy_root("/data", a), STREAM) == "/data/site=site-a/stream=orders"
    assert copy_root("/data", plain) == copy_root("/data", None) == "/data"
    with pytest.raises(ArchiveOwnerError, match="cannot name"):
        copy_root("/data", CopyId(domain="a/../b", stream=STREAM, created="1"))


def test_owner_records_on_a_hadoop_filesystem(sp: Any, tmp_path: Path) -> None:
    """The owner record through Spark's Hadoop layer (how S3 and HDFS are reached), here on
    its local filesystem: created once, never replaced, and read back."""
    fs = HadoopFs(sp)
    directory = f"file://{tmp_path}/remote/stream={STREAM}"
    ckpt = tmp_path / "ckpt" / archive_query_name(STREAM)
    copy = CopyId(domain="", stream=STREAM, created="1")
    assert fs.names(directory) is None and fs.read(f"{directory}/{OWNER_FILE}") is None
    owner = claim_archive(directory, ckpt, copy, fs)
    assert claim_archive(directory, ckpt, copy, fs) == owner  # its own writer again
    assert fs.create(f"{directory}/{OWNER_FILE}", b"{}") is False  # never replaced
    assert json.loads(fs.read(f"{directory}/{OWNER_FILE}") or b"")["writer"] == owner.writer
    assert OWNER_FILE in (fs.names(directory) or [])
    with pytest.raises(ArchiveOwnerError, match="owned by another writer"):
        claim_archive(directory, tmp_path / "other" / archive_query_name(STREAM), copy, fs)


# --------------------------------------------------------------------------- the driver


def _cfg(state: Path, url: str, root: Path) -> Config:
    archived = {"path": str(root), "flush_s": 1.0}
    return load(
        environ={},
        overrides={
            "state_dir": str(state),
            "nats": {"url": url},
            "ray": {"namespace": "tf-archive-owner"},
            "spark": {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": 2}},
            "streams": {  # orders first: retention trims in this order, in one pass
                STREAM: {"subjects": [f"raw.{STREAM}.>"], "archive": archived, "max_age_s": 1},
                "probe": {"subjects": ["raw.probe.>"], "archive": archived, "max_age_s": 1},
            },
        },
    )


async def _state(url: str, stream: str) -> tuple[int, int]:
    from runtime.nats.server import connect

    nc = await connect(url)
    try:
        state = (await nc.jetstream().stream_info(stream)).state
        return state.first_seq, state.messages
    finally:
        await nc.close()


def test_the_driver_refuses_an_archive_it_does_not_own_and_purges_nothing_of_it(
    sp: Any, nats_factory: Any, ray_module: Any, tmp_path: Path
) -> None:
    """The driver's checkpoint archived up to seq 301 elsewhere; the configured directory is
    another writer's. The archive query fails with the reason in `status()`, and retention,
    which trims the other archived stream meanwhile, purges nothing of this one."""
    url = nats_factory(sync_interval="2m").url
    root = tmp_path / "archive"
    cfg = _cfg(tmp_path / "state", url, root)
    with_nats(lambda nc: ensure_streams(nc, cfg), url)
    send(url, "o", 0, 300)
    send(url, "p", 0, 50, stream="probe")
    run_once(sp, url, root, tmp_path / "other-deployment")  # owns <root>/stream=orders
    run_once(sp, url, tmp_path / "elsewhere", queries_root(cfg))  # the driver's checkpoint
    assert archive_position(queries_root(cfg), STREAM).next_seq == 301  # type: ignore[union-attr]

    with running_driver(cfg, url) as driver:
        error = wait_until(
            lambda: (
                ray.get(driver.status.remote(), timeout=30)["queries"]
                .get(archive_query_name(STREAM), {})
                .get("error")
            ),
            180,
            0.2,
            what="the archive refusing a directory it does not own",
        )
        directory = archive_dir(root, STREAM)
        assert directory in error and str(tmp_path / "other-deployment") in error, error
        # a retention pass trimmed the probe (archived by the driver itself) ...
        wait_until(
            lambda: (
                (ray.get(driver.archives.remote(), timeout=30)["probe"]["purged_below"] or 0) > 1
            ),
            180,
            0.2,
            what="retention trimming the probe stream",
        )
        # ... and in the same pass left every event of the refused archive's stream
        assert asyncio.run(_state(url, STREAM)) == (1, 300)
        assert ray.get(driver.archives.remote(), timeout=30)[STREAM]["purged_below"] is None
        answer = ray.get(driver.sql.remote("SELECT count(*) AS n FROM orders"), timeout=120)
        assert answer["status"] == 200 and answer["rows"] == [[300]], answer
