"""Analysis across copies of a replicated stream: when site A is lost, the
analysis driver restarted on site B's copy with the same checkpoint root never applies A's
positions (sequences of A's copy) to B. Jobs that merge are recomputed over B's copy and go
on from there; the others start over on it; the archive refuses.

Pure: the copy comparison and the decision (jobs/copies.py). Real parts: two NATS sites
(runtime/geo/sites.py, JetStream domains joined by a leaf link, one node each), a local Ray, the
AnalysisDriver actor with Spark local[2]; B's copy is read independently with nats-py.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray

from cluster.cli.sites import promote_site
from cluster.history import archive_status, endpoint, on_this_copy, sql_tables
from jobs.archive import archive_position, archive_query_name
from jobs.batch_view import BatchView, fresh_generation, load_view, save_view
from jobs.copies import (
    Action,
    CopyError,
    CopyId,
    acurrent_copy,
    decide,
    read_copy,
    record_copy,
)
from jobs.copy_tracker import archive_copy_error
from jobs.sink import results_by_query
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.geo.replication import link_deny
from runtime.geo.sites import NatsSites
from runtime.job_specs import deadletter_query_name, decode_spec
from runtime.nats.server import connect
from runtime.waiting import await_until, wait_until
from tests.support import running_driver, with_nats

pytestmark = pytest.mark.timeout(600)
STREAM, SUBJECT = "orders", "shop.orders"
REGIONS = ("north", "south", "east", "west")
A = CopyId(domain="site-a", stream=STREAM, created="2026-11-24T10:00:00.123456789Z")
B = CopyId(domain="site-b", stream=STREAM, created="2026-11-24T10:00:01.5Z")


# --------------------------------------------------------------------------- pure


@pytest.mark.unit
def test_decide_never_resumes_positions_of_another_copy() -> None:
    for kind in ("count", "topn", "distinct", "sample", "custom", "archive", "deadletter"):
        assert decide(kind, None, A) is Action.RECORD, kind
        assert decide(kind, A, A) is Action.RESUME, kind
        assert decide(kind, A, msgspec.structs.replace(A)) is Action.RESUME, kind
    expected = {
        "count": Action.RECOMPUTE,
        "topn": Action.RECOMPUTE,
        "distinct": Action.RECOMPUTE,
        "sample": Action.FRESH,
        "custom": Action.FRESH,
        "deadletter": Action.FRESH,
        "archive": Action.REFUSE,
    }
    recreated = msgspec.structs.replace(A, created="2026-11-24T11:00:00Z")  # same site
    other_site_same_time = msgspec.structs.replace(A, domain="site-b")
    for kind, action in expected.items():
        for current in (B, recreated, other_site_same_time):
            assert decide(kind, A, current) is action, (kind, current)
    assert "site-a" in A.describe() and A.created in A.describe()
    assert "(no domain)" in CopyId(domain="", stream="s", created="t").describe()


@pytest.mark.unit
def test_copy_records_round_trip_and_an_unreadable_one_is_an_error(tmp_path: Path) -> None:
    ckpt = tmp_path / "job"
    assert read_copy(ckpt) is None
    record_copy(ckpt, A)
    assert read_copy(ckpt) == A
    record_copy(ckpt, B)  # replaced atomically
    assert read_copy(ckpt) == B and not list(ckpt.glob("*.tmp"))
    (ckpt / "tierflow-copy.json").write_text("{half")
    with pytest.raises(CopyError, match="unreadable"):
        read_copy(ckpt)


@pytest.mark.unit
def test_views_record_their_copy_and_old_views_still_load(tmp_path: Path) -> None:
    spec = decode_spec({"name": "s", "kind": "sample", "stream": STREAM, "field": "region"})
    fresh = fresh_generation(spec, 7, B)
    assert (fresh.high_water, fresh.rows, fresh.copy, fresh.generation) == (0, [], B, 7)
    save_view(tmp_path, fresh)
    assert load_view(tmp_path, "s") == fresh
    old = msgspec.to_builtins(fresh)
    del old["copy"]  # a view saved before copies were recorded
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=BatchView).copy is None


@pytest.mark.unit
def test_archive_of_another_copy_has_no_position_here(tmp_path: Path) -> None:
    ckpt = tmp_path / archive_query_name(STREAM)
    for d in ("commits", "offsets"):
        (ckpt / d).mkdir(parents=True)
    (ckpt / "commits" / "0").write_text("v1\n{}")
    (ckpt / "offsets" / "0").write_text('v1\n{}\n{"seq": 42, "skipped": 0}')
    record_copy(ckpt, A)
    assert archive_position(tmp_path, STREAM).next_seq == 42  # type: ignore[union-attr]
    assert archive_position(tmp_path, STREAM, A).next_seq == 42  # type: ignore[union-attr]
    assert archive_position(tmp_path, STREAM, B) is None
    why = archive_copy_error(STREAM, A, B, "/data/archive")
    for part in ("site-a", "site-b", "archive-orders", "/data/archive/stream=orders", "path"):
        assert part in why, part


# --------------------------------------------------------------------------- real sites


def _cfg(state: Path, url: str) -> Config:
    return load(
        environ={},
        overrides={
            "state_dir": str(state),
            "nats": {"url": url},
            "ray": {"namespace": "tf-geo-analysis"},
            "spark": {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": 2}},
            "streams": {
                STREAM: {
                    "subjects": [f"{SUBJECT}.>"],
                    "replicas": 1,
                    "replicate": {"to": ["site-b"]},
                }
            },
        },
    )


JOBS = [
    {"name": "top", "kind": "topn", "stream": STREAM, "field": "sku", "n": 4, "trigger_s": 1.0},
    {"name": "cnt", "kind": "count", "stream": STREAM, "by": ["region"], "trigger_s": 1.0},
    {"name": "smp", "kind": "sample", "stream": STREAM, "field": "sku", "n": 3, "trigger_s": 1.0},
]


@pytest.fixture
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsSites]:
    cfg = _cfg(tmp_path_factory.mktemp("geo-cfg"), "")
    with NatsSites(
        tmp_path_factory.mktemp("sites"), sites=2, nodes=1, sync_interval="2m", deny=link_deny(cfg)
    ) as s:
        yield s


async def _publish(url: str, prefix: str, n: int, seed: int, start: int = 0) -> None:
    """`n` orders with ids `<prefix>-<i>`, acknowledged by the site at `url`."""
    rng = random.Random(seed)
    nc = await connect(url)
    try:
        js = nc.jetstream(timeout=10)
        for i in range(start, start + n):
            region = rng.choice(REGIONS)
            order = {"region": region, "sku": f"sku-{int(rng.paretovariate(1.1)) % 12}"}
            await js.publish(
                f"{SUBJECT}.{region}",
                json.dumps(order).encode(),
                headers={"Nats-Msg-Id": f"{prefix}-{i}"},
            )
    finally:
        await nc.close()


async def _copy_events(url: str) -> list[tuple[str, dict[str, Any]]]:
    """Every event of the site's copy as (id, order), by direct gets, sequence by sequence."""
    from nats.js.errors import NotFoundError

    nc = await connect(url)
    try:
        js = nc.jetstream(timeout=10)
        state = (await js.stream_info(STREAM)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            try:
                msg = await js.get_msg(STREAM, seq)
            except NotFoundError:
                continue
            out.append((msg.headers["Nats-Msg-Id"], json.loads(msg.data)))
        return out
    finally:
        await nc.close()


def _exact(events: list[tuple[str, dict[str, Any]]]) -> tuple[Counter[str], Counter[str]]:
    ids = Counter(i for i, _ in events)
    assert set(ids.values()) == {1}, "the copy holds an id twice"
    return Counter(e["region"] for _, e in events), Counter(e["sku"] for _, e in events)


def _assert_results_exact(url: str) -> int:
    """The site's results KV equals the exact answer over its copy, computed here; returns
    the number of events counted."""
    events = asyncio.run(_copy_events(url))
    regions, skus = _exact(events)
    got = with_nats(lambda nc: results_by_query(nc.jetstream()), url)
    assert {k: v["count"] for k, v in got["cnt"].items()} == dict(regions)
    top = got["top"]["all"]
    assert top["events"] == len(events)
    for row in top["top"]:  # every count in the list exact, and the list the top 4
        assert row["count"] == skus[row["item"]], row
    assert [r["count"] for r in top["top"]] == sorted(skus.values(), reverse=True)[:4]
    return len(events)


async def _converged(a: str, b: str, n: int) -> bool:
    for url in (a, b):
        nc = await connect(url)
        try:
            if (await nc.jetstream().stream_info(STREAM)).state.messages != n:
                return False
        finally:
            await nc.close()
    return True


def _committed(driver: Any, names: list[str], seq: int) -> None:
    """Wait until each of the queries `names` has committed its input below `seq`."""

    def done() -> bool:
        rows = ray.get(driver.status.remote(), timeout=30)["queries"]
        return all(int((rows.get(n) or {}).get("committed_seq") or 0) >= seq for n in names)

    wait_until(done, 240, 0.2, what=f"{names} committed up to {seq}")


def _idle(driver: Any) -> None:
    done = ray.get(driver.await_idle.remote(240), timeout=270)
    assert done["idle"], done


@pytest.mark.chaos
@pytest.mark.skipif(
    "'chaos' not in (config.getoption('markexpr') or '')",
    reason="runs with -m chaos (make chaos); the short form is the recreated stream",
)
def test_driver_moved_to_site_b_recomputes_over_b_copy_exactly(
    sites: NatsSites,
    ray_module: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Site A lost: the driver restarted on B with the same checkpoint root serves the exact
    answer over B's copy (~100 s: two driver starts; in `make chaos`)."""
    a, b = sites.site("site-a").url, sites.site("site-b").url
    state = tmp_path_factory.mktemp("geo-analysis")
    cfg_a = _cfg(state, a)
    with_nats(lambda nc: ensure_streams(nc, cfg_a), a)  # both copies, A's runtime streams
    asyncio.run(_publish(a, "a", 300, seed=1))
    asyncio.run(_publish(b, "b", 200, seed=2))
    asyncio.run(_publish(a, "both", 20, seed=3))  # a producer's retry on B
    asyncio.run(_publish(b, "both", 20, seed=3))  # with the same ids
    asyncio.run(await_until(lambda: _converged(a, b, 520), 30, 0.2, "both copies"))
    copy_a = with_nats(lambda nc: acurrent_copy(nc, STREAM), a)
    copy_b = with_nats(lambda nc: acurrent_copy(nc, STREAM), b)
    assert copy_a.domain == "site-a" and copy_b.domain == "site-b" and copy_a != copy_b

    with running_driver(cfg_a, a, JOBS) as driver:
        _idle(driver)
        assert _assert_results_exact(a) == 520
        rows = ray.get(driver.status.remote(), timeout=30)["queries"]
        assert rows["cnt"]["copy"] == copy_a.describe() and "copy_change" not in rows["cnt"]
    root = state / "spark"
    assert read_copy(root / "cnt") == copy_a and read_copy(root / "top") == copy_a

    # site A is lost (only the pids we started); B is promoted and takes more writes,
    # interleaved in B's sequences with what it sourced from A
    assert sites.kill_site("site-a")
    cfg_b = _cfg(state, b)
    promotion = asyncio.run(promote_site(cfg_b, "site-b", b))
    assert promotion.ok, promotion.problems
    asyncio.run(_publish(b, "b", 100, seed=4, start=200))

    with running_driver(cfg_b, b, JOBS) as driver:  # same state dir: same checkpoint root
        _idle(driver)
        assert _assert_results_exact(b) == 620  # B's copy: 300 + 200 + 20 + 100, each once
        rows = ray.get(driver.status.remote(), timeout=30)["queries"]
        for name in ("cnt", "top"):
            change = rows[name]["copy_change"]
            assert change["action"] == "recomputed" and change["from"] == copy_a.describe()
            assert rows[name]["copy"] == copy_b.describe() == change["to"]
            view = load_view(root, name)
            assert view is not None and view.copy == copy_b and view.served
            assert read_copy(root / f"{name}@{view.generation}") == copy_b
            assert not (root / name).exists()  # A's positions are gone
        smp = rows["smp"]  # a sample does not merge: a fresh generation over B's copy
        assert smp["copy_change"]["action"] == "started over" and smp["state"] == "running"
        fresh = load_view(root, "smp")
        assert fresh is not None and fresh.copy == copy_b and fresh.high_water == 0
        assert read_copy(root / f"smp@{fresh.generation}") == copy_b
        dl = rows[deadletter_query_name(STREAM)]
        assert dl["copy_change"]["action"] == "started over" and dl["copy"] == copy_b.describe()
        asyncio.run(_publish(b, "b", 150, seed=5, start=300))  # the speed layer
        _idle(driver)
        assert _assert_results_exact(b) == 770


def test_recreated_stream_is_another_copy_and_jobs_are_recomputed_over_it(
    nats_factory: Any, ray_module: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The short form (one site, one driver): a stream deleted and made again restarts its
    sequences at 1, so it is another copy. A job stopped before and started after never
    resumes its old positions on it: it is recomputed over the new stream (not over the
    old stream's archive), exactly; the archive refuses to resume and says why."""
    url = nats_factory(sync_interval="2m").url
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("geo-recreated")),
            "nats": {"url": url},
            "ray": {"namespace": "tf-geo-recreated"},
            "spark": {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": 2}},
            "streams": {STREAM: {"subjects": [f"{SUBJECT}.>"], "archive": {"flush_s": 1.0}}},
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), url)
    asyncio.run(_publish(url, "old", 200, seed=6))
    jobs = [{**j, "trigger_s": 0.5} for j in JOBS[:2]]
    root = Path(cfg.state_path) / "spark"
    with running_driver(cfg, url, jobs) as driver:
        _committed(driver, [j["name"] for j in jobs], 201)  # all 200 (dead letters aside)
        assert _assert_results_exact(url) == 200
        _committed(driver, [archive_query_name(STREAM)], 201)  # the old stream, archived
        first = with_nats(lambda nc: acurrent_copy(nc, STREAM), url)
        nats = endpoint(cfg, "analysis", "tierflow-sql")
        assert not archive_status(cfg)[0]["other_copy"]  # `tierflow archive status`
        assert on_this_copy(sql_tables(cfg), nats)[STREAM].archive_root is not None
        for spec in jobs:
            ray.get(driver.stop.remote(spec["name"], 60.0), timeout=90)
        with_nats(lambda nc: nc.jetstream().delete_stream(STREAM), url)
        with_nats(lambda nc: ensure_streams(nc, cfg), url)
        asyncio.run(_publish(url, "new", 120, seed=7))  # sequences 1..120 again
        second = with_nats(lambda nc: acurrent_copy(nc, STREAM), url)
        assert second != first and second.domain == first.domain == ""
        for spec in jobs:
            row = ray.get(driver.start.remote(spec, 120.0), timeout=150)
            assert row["state"] == "running" and row["copy_change"]["action"] == "recomputed"
            view = load_view(root, spec["name"])
            assert view is not None and view.copy == second and view.high_water == 120
        asyncio.run(_publish(url, "new", 60, seed=8, start=120))  # the speed layer's
        _committed(driver, [j["name"] for j in jobs], 181)
        assert _assert_results_exact(url) == 180  # not 200 + 180
        archive = wait_until(
            lambda: ray.get(driver.archives.remote(), timeout=30)[STREAM]["copy_error"],
            120,
            0.2,
            what="the archive refusing the new copy",
        )
        assert first.created in archive and second.created in archive, archive
        assert f"stream={STREAM}" in archive
        # the operator's tools agree: the archive is marked, `tierflow sql` reads the new
        # stream's own events instead of the old stream's archive
        (row,) = archive_status(cfg)
        assert row["other_copy"] and row["archived_to_seq"] == 0 and row["lag_events"] == 180
        assert on_this_copy(sql_tables(cfg), nats)[STREAM].archive_root is None
