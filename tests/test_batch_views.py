"""Batch views (the Lambda architecture's batch layer): a job's state dropped, recomputed
over the archive and the live tail, and served merged with its speed layer, equals an
uninterrupted run of the same job.

Real parts: nats-server, a local Ray, the AnalysisDriver actor with Spark local[2], the
archive's Parquet on the local filesystem. A stranger's stream (``orders`` on
``shop.orders.<region>``), a job on one region's subjects only, and three kinds that merge.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray

from cluster.analysis import jobs_recompute, jobs_start, jobs_stop
from jobs.archive import queries_root
from jobs.batch_view import (
    BatchView,
    check_mergeable,
    checkpoint_dir,
    load_view,
    merged_count,
    merged_sketch,
    retire_checkpoints,
    save_view,
)
from jobs.driver import AnalysisDriverError
from jobs.recompute import subject_regex
from jobs.sink import results_by_query
from jobs.sketches import Distinct
from jobs.topn import COUNT, ITEM, TopBase, TopState, apply_batch, rank
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.errors import JobError
from runtime.job_specs import JobSpec, decode_spec
from runtime.waiting import wait_until
from tests.support import BackgroundLoad, NatsFactory, running_driver, with_nats

pytestmark = pytest.mark.timeout(900)
STREAM = "orders"
REGIONS = ("north", "south", "east", "west")


def job(name: str, kind: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, "stream": STREAM, "trigger_s": 1.0, **kw}


# The reference jobs run uninterrupted; the `re_` twins have their state dropped and are
# recomputed. Same specs but for the name.
SPECS = {
    "top": dict(kind="topn", field="items[].sku", n=5),
    "north": dict(kind="count", by=["sku0"], subject=f"shop.{STREAM}.north"),
    "uniq": dict(kind="distinct", field="customer", lg_k=12),
}


def specs(prefix: str) -> list[dict[str, Any]]:
    return [job(f"{prefix}{name}", **kw) for name, kw in SPECS.items()]


# --------------------------------------------------------------------------- pure parts


@pytest.mark.unit
def test_top_base_merges_to_the_uninterrupted_top_lists() -> None:
    rows = lambda counts, events: [  # noqa: E731
        *({ITEM: i, COUNT: c} for i, c in counts.items()),
        {ITEM: None, COUNT: events},
    ]
    history = {"a": 5, "b": 3, "c": 1}
    base = TopBase.from_rows(rows(history, 7), windowed=False)
    assert (base.events, base.counts) == (7, history)
    # the speed layer counted c four times and d twice since the high-water sequence
    merged = base.added(rows({"c": 4, "d": 2}, 3), windowed=False)
    state, out = apply_batch(base.state(2, None), merged, 0, 2, None)
    uninterrupted = rank({"a": 5, "b": 3, "c": 5, "d": 2}.items(), 2)
    assert out[None] == (uninterrupted, 10) and state.top == uninterrupted
    assert base.state(2, None) == TopState(events=7, top=[("a", 5), ("b", 3)])


@pytest.mark.unit
def test_windowed_top_base_adds_per_window() -> None:
    rows = [
        {"_tf_start": 0, "_tf_end": 60, ITEM: "x", COUNT: 2},
        {"_tf_start": 60, "_tf_end": 120, ITEM: "y", COUNT: 1},
        {"_tf_start": 60, "_tf_end": 120, ITEM: None, COUNT: 1},
    ]
    base = TopBase.from_rows(rows, windowed=True)
    assert base.newest_start == 60 and base.windows[60] == (120, {"y": 1})
    speed = [{"_tf_start": 60, "_tf_end": 120, ITEM: "y", COUNT: 3}]
    assert base.added(speed, windowed=True)[0][COUNT] == 4
    assert set(base.state(3, delay_ms=0).windows) == {60}  # the window at 0 is closed


@pytest.mark.unit
def test_views_refuse_kinds_that_do_not_merge_and_round_trip(tmp_path: Path) -> None:
    for kind, extra in (("sample", {}), ("custom", {"function": "m:f"})):
        spec = decode_spec(job("s", kind, **extra))
        with pytest.raises(JobError, match="cannot be recomputed"):
            check_mergeable(spec)
    spec = decode_spec(job("c", "count", by=["region"]))
    view = BatchView(spec=spec, generation=5, high_water=9, computed_at_ms=1, counts={"n": 2})
    assert load_view(tmp_path, "c") is None
    save_view(tmp_path, view)
    assert load_view(tmp_path, "c") == view
    assert merged_count(view, {"key": "n", "count": 3}, "count")["count"] == 5
    assert merged_count(view, {"key": "s", "count": 3}, "count")["count"] == 3
    assert checkpoint_dir(tmp_path, "c", view) == tmp_path / "c@5"
    assert checkpoint_dir(tmp_path, "c", None) == tmp_path / "c"
    for old in ("c", "c@3", "c@5", "cc"):
        (tmp_path / old).mkdir()
    retire_checkpoints(tmp_path, "c", keep=tmp_path / "c@5")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["c@5", "cc", "views"]


@pytest.mark.unit
def test_merged_sketches_estimate_like_one_sketch_of_the_union() -> None:
    def sketch(items: range) -> Distinct:
        d = Distinct(12)
        for i in items:
            d.update(f"c{i}")
        return d

    spec = decode_spec(job("u", "distinct", field="customer"))
    for n in (100, 1900, 20_000):  # list/set mode, then HLL mode
        one = sketch(range(n))
        view = BatchView(
            spec=spec,
            generation=1,
            high_water=1,
            computed_at_ms=1,
            sketches={"all": sketch(range(n // 2)).to_bytes()},
        )
        merged = merged_sketch(view, "all", sketch(range(n // 3, n)).to_bytes())
        alone = merged_sketch(None, "all", one.to_bytes())
        assert merged.estimate() == alone.estimate(), n
        assert merged.bounds(2) == alone.bounds(2), n
        assert abs(alone.estimate() - n) <= one.relative_error(3) * n


@pytest.mark.unit
def test_subject_patterns_as_regex() -> None:
    import re

    rx = re.compile(subject_regex("shop.*.north, audit.>"))
    assert rx.match("shop.orders.north") and rx.match("audit.a.b")
    assert not rx.match("shop.orders.south") and not rx.match("audit")
    assert not rx.match("shopXorders.north") and not rx.match("shop.a.b.north")


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    return nats_factory(sync_interval="2m").url


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Config:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("batch-views")),
            "nats": {"url": nats_url},
            "ray": {"namespace": "tf-batch-views"},
            "spark": {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": 2}},
            "streams": {
                STREAM: {"subjects": [f"shop.{STREAM}.>"], "archive": {"flush_s": 1.0}},
            },
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    return cfg


@pytest.fixture(scope="module")
def driver(ray_module: Any, cfg: Config, nats_url: str) -> Iterator[Any]:
    with running_driver(cfg, nats_url, [*specs(""), *specs("re_")]) as handle:
        yield handle


class Orders(BackgroundLoad):
    """Publishes 50 orders every 0.1 s with ids (retried with the same id until acked),
    some malformed; stops by itself after `limit` orders."""

    def __init__(self, url: str, start: int, limit: int, seed: int) -> None:
        super().__init__(url)
        self.n, self.end, self.rng = start, start + limit, random.Random(seed)

    async def main(self, nc: Any) -> None:
        js = nc.jetstream(timeout=10)
        while self.n < self.end and not self.stopping:
            batch = []
            for _ in range(min(50, self.end - self.n)):
                region = self.rng.choice(REGIONS)
                skus = [f"sku-{int(self.rng.paretovariate(1.2)) % 40}" for _ in range(3)]
                order = {
                    "region": region,
                    "customer": f"c{self.rng.randrange(3000)}",
                    "items": [{"sku": s} for s in skus[: self.rng.randint(0, 3)]],
                    "sku0": skus[0],
                }
                body = b"{not json" if self.n % 97 == 0 else json.dumps(order).encode()
                batch.append((f"shop.{STREAM}.{region}", f"o-{self.n}", body))
                self.n += 1
            for attempt in range(20):
                try:
                    futs = [
                        await js.publish_async(s, b, headers={"Nats-Msg-Id": i})
                        for s, i, b in batch
                    ]
                    await asyncio.gather(*futs)
                    break
                except Exception:  # noqa: BLE001 - resent with the same ids
                    if attempt == 19:
                        raise
                    await asyncio.sleep(0.2)
            await asyncio.sleep(0.1)


def kv(url: str) -> dict[str, dict[Any, Any]]:
    return with_nats(lambda nc: results_by_query(nc.jetstream()), url)


def idle(driver: Any) -> None:
    done = ray.get(driver.await_idle.remote(300), timeout=330)
    assert done["idle"], done


def archived_next(driver: Any) -> int:
    return int(ray.get(driver.archives.remote(), timeout=30)[STREAM]["next_seq"])


def assert_twins_equal(url: str) -> None:
    got = kv(url)
    for name in SPECS:
        assert got.get(f"re_{name}") == got.get(name), name
        assert got[name], name


def test_recompute_after_dropped_state_equals_an_uninterrupted_run(
    driver: Any, cfg: Config, nats_url: str
) -> None:
    root = queries_root(cfg)
    first = Orders(nats_url, 0, 1500, seed=1).start()
    first.finish()
    wait_until(lambda: archived_next(driver) > 1000, 120, 0.2, what="the archive")
    idle(driver)
    assert_twins_equal(nats_url)

    # lose the twins' state: stop them, delete their checkpoints, start them again
    names = [f"re_{n}" for n in SPECS]
    for name in names:
        jobs_stop(cfg, name)
        shutil.rmtree(root / name)
    more = Orders(nats_url, 1500, 1500, seed=2).start()  # the stream goes on meanwhile
    for name in names:
        jobs_start(cfg, json.dumps(job(name, **SPECS[name.removeprefix("re_")])))
    # one through the CLI's function, the others at the same time straight to the driver
    others = [driver.recompute.remote(name, 120.0) for name in names[1:]]
    rows = [*jobs_recompute(cfg, names[0]), *ray.get(others, timeout=600)]
    for name, row in zip(names, rows, strict=True):
        assert row["state"] == "running" and row["keys"] > 0, row
        assert row["high_water"] >= 1500 and archived_next(driver) > 1  # archive and tail
        view = load_view(root, name)
        assert view is not None and view.served and not (root / name).exists()
        assert (root / f"{name}@{view.generation}").is_dir()
    more.finish()
    idle(driver)
    assert_twins_equal(nats_url)

    # a second recompute: a newer generation, equal again; the results stream's latest
    # top-N row is the merged view too
    (row,) = jobs_recompute(cfg, "re_top")
    tail = Orders(nats_url, 3000, 400, seed=3).start()
    tail.finish()
    idle(driver)
    assert_twins_equal(nats_url)
    latest = with_nats(
        lambda nc: nc.jetstream().get_last_msg("results", "results.re_top"), nats_url
    )
    assert msgspec.json.decode(latest.data) == kv(nats_url)["top"]["all"]
    assert latest.headers["Nats-Msg-Id"].startswith(f"re_top@{row['generation']}:")
    assert kv(nats_url)["top"]["all"]["events"] == 3400 - len(range(0, 3400, 97))


def test_recompute_refuses_what_cannot_merge_or_is_not_running(driver: Any, cfg: Config) -> None:
    jobs_start(cfg, json.dumps(job("sampled", "sample", field="region", n=3)))
    with pytest.raises(AnalysisDriverError, match="cannot be recomputed"):
        jobs_recompute(cfg, "sampled")
    with pytest.raises(AnalysisDriverError, match="not running in the driver"):
        jobs_recompute(cfg, "nope")
    jobs_stop(cfg, "sampled")


def test_job_specs_in_this_module_are_valid() -> None:
    for raw in [*specs(""), *specs("re_")]:
        assert isinstance(decode_spec(raw), JobSpec)


# --------------------------------------------------------------------------- windows


WINDOWED = {
    "wcount": dict(
        kind="count",
        by=["region"],
        window={"length": "1h", "watermark": "10m"},
        time_field="at",
    ),
    "wtop": dict(
        kind="topn",
        field="items[].sku",
        n=3,
        window={"length": "1h", "slide": "30m", "watermark": "10m"},
        time_field="at",
    ),
}


def test_windowed_jobs_merge_per_window(
    spark: Any, nats_url: str, cfg: Config, tmp_path: Path
) -> None:
    """Event-time windows (tumbling and sliding, on the events' own time): a recompute up
    to the middle of the stream, served, then the speed layer over the rest, equals one
    uninterrupted run, window by window, including the windows the high-water mark cuts.
    (`cfg` made the results stream.)"""
    from jobs.jetstream import register
    from jobs.recompute import recompute, serve_view
    from jobs.running import start_job
    from jobs.sql import StreamTable
    from runtime.nats.server import NatsEndpoint

    register(spark)
    stream = "ticks"

    async def fill(nc: Any) -> None:
        js = nc.jetstream()
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        rng = random.Random(5)
        futs = []
        for i in range(1200):  # in event-time order, 10 s apart: about 3.3 hours
            order = {
                "region": rng.choice(REGIONS),
                "items": [{"sku": f"s{rng.randrange(9)}"} for _ in range(rng.randint(0, 2))],
                "at": 1_790_000_000_000 + i * 10_000,
            }
            body = json.dumps(order).encode()
            futs.append(
                await js.publish_async(f"{stream}.x", body, headers={"Nats-Msg-Id": str(i)})
            )
        await asyncio.gather(*futs)

    with_nats(fill, nats_url)
    nats = NatsEndpoint(nats_url)
    root = tmp_path / "queries"

    def run(spec: JobSpec, view: BatchView | None = None) -> None:
        q = start_job(spark, spec, nats, root, trigger={"availableNow": True}, view=view)
        q.awaitTermination(300)
        assert q.exception() is None, q.exception()

    for name, kw in WINDOWED.items():
        ref = decode_spec({"name": name, "stream": stream, **kw})
        twin = decode_spec({"name": f"re_{name}", "stream": stream, **kw})
        run(ref)
        view = recompute(spark, nats, twin, StreamTable(stream), high_water=600)
        assert view.high_water == 600 and len(view.rows) > 1
        serve_view(nats, view)
        run(twin, view)
        got = kv(nats_url)
        assert len(got[name]) > 3, name  # several windows
        assert got[f"re_{name}"] == got[name], name
