"""A warm pair of analysis drivers is fenced by a NATS KV lease (jobs/standby.py,
runtime/nats/lease.py), and the result sink writes only under it (jobs/sink.py).

Across nodes the checkpoint store's file lock sees nothing, and a busy active driver looks
dead to a peer that asks it with a 2-s timeout. The drivers here are made to be on two
nodes as far as the lock can tell (each its own state directory; the Spark checkpoints
shared, as on NFS), and the active one is paused (SIGSTOP) with its lease still fresh, and
then past its expiry: the standby must not take over in the first case; in the second it
takes over, and the old one, resumed, writes nothing and steps down, the answers exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from nats.aio.client import Client
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from jobs.sink import LeaseFenced, ResultSink, results_by_query, set_fence
from jobs.standby import (
    Take,
    holder_info,
    holder_running,
    host_id,
    lease_key,
    standby_name,
    takeover_action,
)
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.lease import LeaseKeeper, LeaseState
from runtime.nats.server import connect
from runtime.waiting import wait_until
from tests.support import BackgroundLoad, NatsFactory, acked_publish, with_nats

pytestmark = pytest.mark.timeout(900)

EPOCH_HEADER = "Tierflow-Epoch"  # jobs.sink.EPOCH_HEADER, spelled out: the wire's name
ANSWER_TIMEOUT_S = 2.0  # how long a standby used to wait for its peer's answer
PAIR = "fencing-driver"
JOB = "fence_count"


def state(holder: str, revision: int = 7, epoch: int = 5, **info: Any) -> LeaseState:
    return LeaseState(revision, holder, epoch, 0.0, info)


# --------------------------------------------------------------------------- pure policy


@pytest.mark.unit
def test_a_lease_is_taken_only_when_free_ours_or_its_holder_is_gone_from_this_host() -> None:
    here = "boot-1/4026531836"
    assert takeover_action(None, "b/2", here, None) is Take.ACQUIRE  # free, expired, released
    assert takeover_action(state("b/2"), "b/2", here, None) is Take.ACQUIRE  # ours (lost answer)
    # held by another driver: slow to answer, paused or on another node, it keeps the lease
    for running in (True, None):
        assert takeover_action(state("a/1", host=here), "b/2", here, running) is Take.WAIT
    assert takeover_action(state("a/1", host="other"), "b/2", here, None) is Take.WAIT
    # its process on this host is gone (SIGKILL): no wait for the TTL
    gone = state("a/1", host=here, pid=12, pid_started=1.0)
    assert takeover_action(gone, "b/2", here, False) is Take.TAKE_FROM_GONE
    # a driver that cannot name its host never judges anyone gone
    assert takeover_action(state("a/1", host=""), "b/2", "", False) is Take.WAIT


@pytest.mark.unit
def test_only_a_holder_on_this_host_can_be_seen_gone() -> None:
    here = host_id()
    assert here, "Linux names its boot and pid namespace"
    me = holder_info(os.getpid())
    assert holder_running(me, here) is True
    assert holder_running({**me, "pid_started": me["pid_started"] - 5}, here) is False  # reused
    assert holder_running({**me, "host": "elsewhere"}, here) is None
    assert holder_running({}, here) is None
    assert lease_key("tierflow-analysis") == "analysis.tierflow-analysis"
    assert lease_key("odd name.x") == "analysis.odd_name_x"


# --------------------------------------------------------------------------- the lease


@pytest.fixture(scope="module")
def nats_url(nats_factory: NatsFactory) -> str:
    return nats_factory(sync_interval="2m").url


def keeper(url: str, holder: str, ttl_s: int = 2, pid: int | None = None) -> LeaseKeeper:
    return LeaseKeeper(
        lambda: connect(url, name=f"lease-{holder}"),
        "analysis.test-pair",
        holder,
        ttl_s=ttl_s,
        info=holder_info(pid or os.getpid()),
    ).start()


def test_a_held_lease_is_taken_only_once_it_expired_and_the_old_holder_hears_so(
    nats_url: str,
) -> None:
    a, b = keeper(nats_url, "a/1"), keeper(nats_url, "b/1")
    try:
        assert a.acquire() and a.epoch > 0 and a.fresh()
        seen = b.read()
        assert seen is not None and (seen.holder, seen.epoch) == ("a/1", a.epoch)
        assert not b.acquire()  # held: no create over it
        # a stops renewing (paused): the server expires the key a TTL after its last write
        wait_until(b.acquire, 15, 0.1, what="the expired lease taken")
        assert b.epoch > a.epoch
        assert not a.fresh()  # its local fence ran out before the server expired the key
        lost: list[str] = []
        a.keep(lost.append)  # resumed: its first renewal finds b's term
        wait_until(lambda: lost, 15, 0.05, what="the old holder told it lost the lease")
        assert "no longer a/1's" in lost[0] and not a.fresh()
        b.keep(lambda why: None)
        wait_until(lambda: b.read().revision > b.epoch, 15, 0.1, what="b's renewals")  # type: ignore[union-attr]
        assert b.fresh() and b.read().epoch == b.epoch  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()


def test_a_holder_gone_from_this_host_is_taken_at_its_revision_at_once(nats_url: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    a = keeper(nats_url, "a/2", ttl_s=60, pid=proc.pid)
    b = keeper(nats_url, "b/2", ttl_s=60)
    try:
        wait_until(a.acquire, 15, 0.1, what="the lease (an earlier test's may still expire)")
        seen = b.read()
        assert seen is not None
        assert holder_running(seen.info, host_id()) is True
        assert takeover_action(seen, "b/2", host_id(), True) is Take.WAIT
        proc.kill()
        proc.wait(10)
        running = holder_running(seen.info, host_id())
        assert running is False
        assert takeover_action(seen, "b/2", host_id(), running) is Take.TAKE_FROM_GONE
        assert not b.take(seen.revision - 1)  # only at the revision read: never over a newer
        assert b.take(seen.revision) and b.epoch > seen.epoch
        assert not a.take(seen.revision)  # and only once
    finally:
        proc.kill()
        b.close()
        a.close()


def test_a_renewal_that_landed_unanswered_is_not_taken_for_a_lost_lease(nats_url: str) -> None:
    a = keeper(nats_url, "a/3", ttl_s=60)
    try:
        wait_until(a.acquire, 15, 0.1, what="the lease (an earlier test's may still expire)")
        lease = a.lease
        assert lease is not None and lease.revision is not None
        # a renewal the server stored whose answer never came back: the revision moved on
        a._run(lease._write(lease.revision))
        assert a._run(lease.extend()) is True and a.fresh()
        seen = a.read()
        assert seen is not None and (seen.revision, seen.epoch) == (lease.revision, a.epoch)
    finally:
        a.close()


# --------------------------------------------------------------------------- the sink


@dataclass
class Fence:
    """A lease as the sink sees it, set by the test."""

    epoch: int
    is_fresh: bool = True
    confirms: bool = False

    def fresh(self) -> bool:
        return self.is_fresh

    async def confirm(self) -> bool:
        return self.confirms


def add_stream(url: str, name: str, subjects: list[str]) -> None:
    async def go(nc: Client) -> None:
        await nc.jetstream().add_stream(
            StreamConfig(name=name, subjects=subjects, duplicate_window=600)
        )

    with_nats(go, url)


def stream_msgs(url: str, stream: str, subject: str) -> list[tuple[dict[str, str], bytes]]:
    """(headers, data) of every message of `stream` on `subject`, in stream order."""

    async def go(nc: Client) -> list[tuple[dict[str, str], bytes]]:
        js = nc.jetstream()
        st = (await js.stream_info(stream)).state
        out = []
        for seq in range(max(st.first_seq, 1), st.last_seq + 1):
            try:
                m = await js.get_msg(stream, seq)
            except NotFoundError:
                continue
            if m.subject == subject:
                out.append((dict(m.headers or {}), m.data or b""))
        return out

    return with_nats(go, url)


@pytest.fixture(scope="module")
def sink_url(nats_factory: NatsFactory) -> str:
    url = nats_factory(sync_interval="2m").url
    add_stream(url, "results", ["results.>"])
    add_stream(url, "deadletter", ["deadletter.>"])
    return url


@pytest.fixture
def fence() -> Iterator[Fence]:
    f = Fence(epoch=5)
    set_fence(f)
    try:
        yield f
    finally:
        set_fence(None)


def kv_rows(url: str, bucket: str) -> dict[str, dict[Any, Any]]:
    return with_nats(lambda nc: results_by_query(nc.jetstream(), bucket), url)


def test_a_sink_whose_lease_is_stale_writes_nothing(sink_url: str, fence: Fence) -> None:
    sink = ResultSink.for_query(sink_url, "fenced", kv_bucket="fenced_kv", run_id="r")
    try:
        sink.publish_results([{"key": "k", "n": 1}], 0)
        msgs = stream_msgs(sink_url, "results", "results.fenced")
        assert [h[EPOCH_HEADER] for h, _ in msgs] == ["5"]
        fence.is_fresh = False  # paused past its lease, or the renewals fail
        with pytest.raises(LeaseFenced, match="epoch 5"):
            sink.publish_results([{"key": "k", "n": 2}], 1)
        with pytest.raises(LeaseFenced):
            sink.dead_letter([{"seq": 1, "raw": b"x", "error": "bad"}], "s")
        assert len(stream_msgs(sink_url, "results", "results.fenced")) == 1
        assert stream_msgs(sink_url, "deadletter", "deadletter.s") == []
        assert kv_rows(sink_url, "fenced_kv") == {"fenced": {"k": {"key": "k", "n": 1}}}
    finally:
        sink.close()


def test_a_kv_value_of_a_newer_epoch_refuses_the_older_writer(sink_url: str, fence: Fence) -> None:
    new = ResultSink.for_query(sink_url, "epochs", kv_bucket="epochs_kv", run_id="r")
    old = ResultSink.for_query(sink_url, "epochs", kv_bucket="epochs_kv", run_id="r")
    try:
        fence.epoch = 9  # the new holder writes batch 3
        new.publish_results([{"key": "k", "n": 3}], 3)
        fence.epoch = 5  # a writer of epoch 5 that still thinks itself fresh
        with pytest.raises(LeaseFenced, match="epoch 9, newer than this driver's 5"):
            old.publish_results([{"key": "k", "n": 4}], 4)
        assert kv_rows(sink_url, "epochs_kv")["epochs"]["k"]["n"] == 3
        # the lease bucket was made anew (its revisions start over): the holder it still
        # names writes on, by the run and batch order
        fence.confirms = True
        assert old.publish_results([{"key": "k", "n": 4}], 4).kv_puts == 1
        assert kv_rows(sink_url, "epochs_kv")["epochs"]["k"]["n"] == 4
    finally:
        new.close()
        old.close()


# --------------------------------------------------------------------------- the pair


class Load(BackgroundLoad):
    """Events at a steady rate, each acknowledged (resent with its id until it is)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.sent = 0

    async def main(self, nc: Any) -> None:
        js = nc.jetstream(timeout=10)
        while not self.stopping:
            for _ in range(2):
                body = json.dumps({"n": self.sent, "g": "all"}).encode()
                for _attempt in range(50):
                    if await acked_publish(js, "raw.fence", body, f"fence-{self.sent}", 5):
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise RuntimeError(f"event {self.sent} not acknowledged")
                self.sent += 1
            await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def pair_cfg(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Config:
    root = tmp_path_factory.mktemp("fencing")
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(root / "state"),
            "nats": {"url": nats_url},
            "ray": {"namespace": "tierflow-tests-fencing"},
            "spark": {
                "master": "local[2]",
                # on storage both nodes see (NFS): each query resumes where either left it
                "checkpoint_dir": str(root / "shared-checkpoints"),
                "conf": {"spark.sql.shuffle.partitions": 2},
            },
            "streams": {"fence": {"subjects": ["raw.fence"]}},
        },
    )
    with_nats(lambda nc: ensure_streams(nc, cfg), nats_url)
    return cfg


def start_pair(cfg: Config, url: str, root: Path) -> list[Any]:
    """The pair, each driver with a state directory of its own (its own node, as far as
    the checkpoint store's lock can tell)."""
    import ray

    from cluster.deploy import analysis

    job = {"name": JOB, "kind": "count", "stream": "fence", "by": ["g"], "trigger_s": 0.5}
    make = getattr(analysis, "driver_class", lambda c: ray.remote(analysis.AnalysisDriver))
    handles = []
    for name, peer in ((PAIR, standby_name(PAIR)), (standby_name(PAIR), PAIR)):
        kwargs = analysis.driver_kwargs(cfg, url, [job], state_dir=root / name, peer=peer)
        options = analysis.supervised_options(
            name, cfg.ray.namespace, **analysis.driver_ray_options(cfg)
        )
        handles.append(make(cfg).options(**options).remote(**{**kwargs, "name": PAIR}))
    return handles


def role(cfg: Config, name: str) -> dict[str, Any]:
    import ray

    handle = ray.get_actor(name, namespace=cfg.ray.namespace)
    return dict(ray.get(handle.role_info.remote(), timeout=30))


def results(url: str) -> list[tuple[int, int]]:
    """(epoch, count) of every result of the job, in the results stream's order."""
    out = []
    for h, data in stream_msgs(url, "results", f"results.{JOB}"):
        out.append((int(h.get(EPOCH_HEADER, 0)), json.loads(data)["count"]))
    return out


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP) until the block ends, whatever happens in it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_paused_active_driver_is_not_taken_over_while_its_lease_lasts_and_is_fenced_after(
    ray_module: Any, pair_cfg: Config, nats_url: str, tmp_path: Path
) -> None:
    from cluster.deploy.analysis import stop_driver

    cfg = pair_cfg
    handles = start_pair(cfg, nats_url, tmp_path)
    load_ = Load(nats_url).start()
    try:
        names = (PAIR, standby_name(PAIR))

        def roles() -> dict[str, dict[str, Any]]:
            return {n: role(cfg, n) for n in names}

        # one active with a first result out, the other standing by (warmed up, waiting)
        both = wait_until(
            lambda: (
                (r := roles())
                and sorted(i["role"] for i in r.values()) == ["active", "standby"]
                and any(i["state"] == "standby" for i in r.values())
                and results(nats_url)
                and r
            ),
            360,
            1.0,
            what="an active driver with results and a standby",
            swallow=True,
        )
        active = next(n for n, i in both.items() if i["role"] == "active")
        standby = next(n for n in names if n != active)
        old = both[active]
        first_epoch = results(nats_url)[-1][0]

        # 1. paused longer than the peer's answer timeout, well within its lease: kept
        with paused(old["pid"]):
            stopped_at = time.time()
            seen = wait_until(
                lambda: (
                    (
                        (s := role(cfg, standby))["took_over"]
                        or (s.get("lease") or {}).get("at", 0) > stopped_at + ANSWER_TIMEOUT_S + 0.5
                    )
                    and s
                ),
                60,
                0.2,
                what="the standby's look at the lease while the active one is paused",
            )
        assert seen["took_over"] is None and seen["role"] == "standby", (
            f"the standby took over from a driver that was only paused: {seen}"
        )
        assert seen["lease"]["action"] == "wait" and seen["lease"]["epoch"] == first_epoch
        assert role(cfg, active)["role"] == "active"

        # 2. paused past its lease: the standby takes over and writes; the old one resumed
        # writes nothing more and steps down
        with paused(old["pid"]):
            took = wait_until(
                lambda: (s := role(cfg, standby))["role"] == "active" and s,
                120,
                0.5,
                what="the standby's takeover once the lease expired",
            )
            new_epoch = took["took_over"]["epoch"]
            assert new_epoch > first_epoch
            wait_until(
                lambda: any(e == new_epoch for e, _ in results(nats_url)),
                180,
                0.5,
                what="the new active driver's first result",
            )
        wait_until(
            lambda: (
                not psutil.pid_exists(old["pid"])
                or psutil.Process(old["pid"]).status() == psutil.STATUS_ZOMBIE
            ),
            60,
            0.2,
            what="the old active driver stepping down",
        )
        back = wait_until(
            lambda: (r := role(cfg, active))["pid"] != old["pid"] and r,
            120,
            1.0,
            what="the old driver back (restarted by Ray)",
            swallow=True,
        )
        assert back["role"] == "standby", back
        assert role(cfg, standby)["role"] == "active"
    finally:
        load_.join()
        sent = load_.sent
    import ray

    driver = ray.get_actor(standby, namespace=cfg.ray.namespace)
    try:
        idle = ray.get(driver.await_idle.remote(180), timeout=240)
        assert idle["idle"], idle
        got = with_nats(lambda nc: results_by_query(nc.jetstream()), nats_url)
        assert got[JOB]["all"]["count"] == sent
        rows = results(nats_url)
        epochs = [e for e, _ in rows]
        cut = epochs.index(new_epoch)
        assert set(epochs[:cut]) == {first_epoch}
        assert set(epochs[cut:]) == {new_epoch}, "a result of the old epoch after the new one's"
        counts = [c for _, c in rows]
        assert counts == sorted(counts) and counts[-1] == sent
    finally:
        stop_driver(handles[0])
