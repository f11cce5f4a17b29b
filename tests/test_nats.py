"""runtime/nats/server.py against a real nats-server: lifecycle, durability, clustering, auth."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StorageType
from nats.js.client import JetStreamContext

from runtime.certs import make_dev_certs
from runtime.config import load
from runtime.nats.server import (
    NatsCluster,
    NatsEndpoint,
    NatsServer,
    NatsServerError,
    connect,
    free_port,
    nats_server_binary,
)

pytestmark = pytest.mark.timeout(120)

MSG_ID = "Nats-Msg-Id"


# ---- helpers ------------------------------------------------------------------------------


def wait_for(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Bounded poll: return once pred() holds, fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def procs_with_arg(arg: str) -> list[int]:
    """Pids whose command line contains `arg` (to prove no stray server was left)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if arg.encode() in cmdline:
            found.append(int(entry.name))
    return found


async def publish_acked(
    js: JetStreamContext,
    subject: str,
    ids: Iterable[str],
    *,
    deadline: float,
    window: int = 200,
    ack_timeout: float = 2.0,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """Publish every id (as Nats-Msg-Id and payload) with acks awaited; retry failures with the
    same id until acked or the deadline. Returns id -> stream sequence for all acked ids."""
    todo = list(ids)
    acked: dict[str, int] = {}
    while todo:
        if time.monotonic() >= deadline:
            break
        batch, todo = todo[:window], todo[window:]
        failed: list[str] = []
        futs = []
        for mid in batch:
            try:
                fut = await js.publish_async(subject, mid.encode(), headers={MSG_ID: mid})
            except (nats.errors.Error, OSError):
                failed.append(mid)
                continue
            futs.append((mid, fut))
        results = await asyncio.gather(
            *(asyncio.wait_for(f, ack_timeout) for _, f in futs), return_exceptions=True
        )
        for (mid, _), res in zip(futs, results, strict=True):
            if isinstance(res, BaseException):
                failed.append(mid)
            else:
                acked[mid] = res.seq
        if failed:
            await asyncio.sleep(0.05)
        todo = failed + todo
        if on_progress is not None:
            on_progress(len(acked))
    return acked


async def read_stream(
    js: JetStreamContext, stream: str, subject: str, expect: int, timeout: float = 20.0
) -> list[tuple[int, str, bytes]]:
    """All messages of `stream` as (seq, msg id, payload), read with a pull consumer."""
    info = await js.stream_info(stream)
    assert info.state.messages == expect, info.state
    durable = f"reader-{time.monotonic_ns()}"
    # R1 in memory: a reader needs no replicated state, and right after a node loss an R3
    # consumer's creation can outlast one API timeout while its raft group elects a leader.
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, num_replicas=1, mem_storage=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sub = await js.pull_subscribe(subject, durable=durable, stream=stream, config=config)
            break
        except nats.errors.TimeoutError:
            if time.monotonic() >= deadline:
                raise
    out: list[tuple[int, str, bytes]] = []
    try:
        while len(out) < expect and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(batch=500, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            except nats.js.errors.ServiceUnavailableError:
                # 503 no responders: the new consumer's assignment has not reached its
                # server yet (seen right after a leader change); it answers once it has.
                await asyncio.sleep(0.1)
                continue
            for m in msgs:
                out.append((m.metadata.sequence.stream, m.headers[MSG_ID], m.data))
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(stream, durable)
    assert len(out) == expect, f"read {len(out)} of {expect} before the deadline"
    return out


@pytest.fixture
def server(tmp_path: Path):
    s = NatsServer(tmp_path / "nats")
    yield s
    s.stop()


# ---- tests --------------------------------------------------------------------------------


@pytest.mark.unit
def test_binary_and_free_port() -> None:
    path = nats_server_binary()
    assert os.access(path, os.X_OK)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # was really free


async def test_single_server_round_trip_and_stop(server: NatsServer) -> None:
    server.start()
    pid = server.pid
    assert pid is not None and server.running and not pid_gone(pid)
    assert server.config_path.is_file() and server.log_path.is_file()
    nc = await connect(server.url, name="test-roundtrip")
    try:
        js = nc.jetstream()
        await js.add_stream(name="RT", subjects=["rt.>"], storage=StorageType.FILE)
        ids = [f"rt-{i:05d}" for i in range(1000)]
        t0 = time.perf_counter()
        acked = await publish_acked(js, "rt.x", ids, deadline=time.monotonic() + 30)
        rate = len(acked) / (time.perf_counter() - t0)
        print(f"\nsingle node: {len(acked)} acked publishes, {rate:,.0f} msg/s")
        assert sorted(acked.values()) == list(range(1, 1001))
        assert [acked[i] for i in ids] == list(range(1, 1001))  # published in order

        sub = await js.pull_subscribe("rt.x", durable="rt-reader", stream="RT")
        got: list[tuple[int, str]] = []
        deadline = time.monotonic() + 20
        while len(got) < 1000 and time.monotonic() < deadline:
            try:
                msgs = await sub.fetch(batch=250, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for m in msgs:
                got.append((m.metadata.sequence.stream, m.headers[MSG_ID]))
                assert m.data.decode() == m.headers[MSG_ID]
                await m.ack()
        assert got == [(i + 1, mid) for i, mid in enumerate(ids)]
        assert (await sub.consumer_info()).num_pending == 0
    finally:
        await nc.close()

    server.stop()
    assert not server.running and server.pid is None
    assert pid_gone(pid)
    server.stop()  # idempotent


@pytest.mark.parametrize(
    ("policy", "sync_always", "interval_ns"),
    [("always", True, None), ("1s", False, 1_000_000_000)],
)
def test_sync_interval_is_what_the_server_runs(
    tmp_path: Path, policy: str, sync_always: bool, interval_ns: int | None
) -> None:
    with NatsServer(tmp_path / "n", sync_interval=policy, max_payload=2 << 20) as s:
        status, varz = s.monitor("varz")
        assert status == 200
        cfg = varz["jetstream"]["config"]
        assert bool(cfg.get("sync_always")) is sync_always
        if interval_ns is not None:
            assert cfg["sync_interval"] == interval_ns
        assert cfg["store_dir"].startswith(str((tmp_path / "n").resolve()))
        assert varz["max_payload"] == 2 << 20
        assert NatsServer(tmp_path / "x").sync_interval == "always"  # the default


async def test_restart_keeps_acked_messages(server: NatsServer) -> None:
    server.start()
    ports = (server.port, server.monitor_port)

    async def publish(ids: list[str]) -> None:
        nc = await connect(server.url)
        try:
            js = nc.jetstream()
            if ids[0].endswith("00000"):
                await js.add_stream(name="D", subjects=["d.>"], storage=StorageType.FILE)
            acked = await publish_acked(js, "d.x", ids, deadline=time.monotonic() + 20)
            assert len(acked) == len(ids)
        finally:
            await nc.close()

    async def read(expect: list[str]) -> None:
        nc = await connect(server.url)
        try:
            rows = await read_stream(nc.jetstream(), "D", "d.x", len(expect))
            assert [mid for _, mid, _ in rows] == expect
            assert [seq for seq, _, _ in rows] == list(range(1, len(expect) + 1))
        finally:
            await nc.close()

    first = [f"a-{i:05d}" for i in range(200)]
    second = [f"b-{i:05d}" for i in range(200)]
    await publish(first)

    old_pid = server.pid
    server.restart()  # clean stop + start
    assert (server.port, server.monitor_port) == ports and server.pid != old_pid
    assert pid_gone(old_pid)
    await read(first)

    await publish(second)
    killed = server.pid
    server.kill()
    assert not server.running and pid_gone(killed)
    server.restart()
    assert (server.port, server.monitor_port) == ports
    await read(first + second)


def test_start_failure_reports_log_and_leaves_no_process(tmp_path: Path) -> None:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        s = NatsServer(tmp_path / "busy", port=taken)
        with pytest.raises(NatsServerError) as info:
            s.start(timeout=10)
        msg = str(info.value)
        assert f"127.0.0.1:{taken}" in msg
        assert "address already in use" in msg.lower()  # from the server log tail
        assert not s.running and s.pid is None
        assert procs_with_arg(str(s.config_path)) == []
        s.stop()  # still safe
    finally:
        holder.close()


async def test_cluster_survives_node_kill_exactly_once(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "cluster", nodes=3)
    try:
        cluster.start()
        assert len(cluster.servers) == 3 and all(s.running for s in cluster.servers)
        assert cluster.meta_leader() in {s.server_name for s in cluster.servers}

        nc = await connect(cluster.url, name="test-cluster")
        try:
            js = nc.jetstream()
            info = await js.add_stream(
                name="C", subjects=["c.>"], storage=StorageType.FILE, num_replicas=3
            )
            assert info.config.num_replicas == 3

            total = 3000
            ids = [f"c-{i:05d}" for i in range(total)]
            progress = asyncio.Event()

            def on_progress(n: int) -> None:
                if n >= total // 3:
                    progress.set()

            t0 = time.perf_counter()
            publisher = asyncio.create_task(
                publish_acked(
                    js, "c.x", ids, deadline=time.monotonic() + 60, on_progress=on_progress
                )
            )
            await asyncio.wait_for(progress.wait(), 30)
            leader = (await js.stream_info("C")).cluster.leader
            victim = cluster.server(leader)
            victim.kill()
            assert not victim.running

            acked = await asyncio.wait_for(publisher, 70)
            elapsed = time.perf_counter() - t0
            print(f"\nR3 with leader {leader} killed: {len(acked)} acked in {elapsed:.1f}s")
            assert len(acked) == total, f"only {len(acked)} of {total} acked before deadline"

            new_leader = (await js.stream_info("C")).cluster.leader
            assert new_leader and new_leader != leader
            rows = await read_stream(js, "C", "c.x", total)
            got = [mid for _, mid, _ in rows]
            assert len(got) == len(set(got)) == total, "duplicates in the stream"
            assert set(got) == set(acked)
            assert all(data.decode() == mid for _, mid, data in rows)
            for seq, mid, _ in rows:
                assert acked[mid] == seq  # the ack named the sequence the message really has
        finally:
            await nc.close()

        victim.restart()
        victim.wait_healthy(timeout=30, query="")  # full check: JetStream current

        def caught_up() -> bool:
            status, body = victim.monitor("jsz?streams=true")
            if status != 200:
                return False
            streams = [
                sd
                for acc in body.get("account_details") or []
                for sd in acc.get("stream_detail") or []
            ]
            return any(sd["name"] == "C" and sd["state"]["messages"] == total for sd in streams)

        wait_for(caught_up, 30, "restarted node to hold all messages of stream C")
        assert cluster.meta_leader() is not None
    finally:
        cluster.stop()
    assert not any(s.running for s in cluster.servers)


async def test_connect_with_user_password(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "auth", user="tierflow", password="s3cret$#x") as s:
        assert "authorization" in s.config_text()
        nc = await connect(s.url, user="tierflow", password="s3cret$#x")
        try:
            assert nc.is_connected
            sub = await nc.subscribe("ping")
            await nc.publish("ping", b"x")
            assert (await sub.next_msg(timeout=2)).data == b"x"
        finally:
            await nc.close()

        with pytest.raises(nats.errors.AuthorizationError):
            await asyncio.wait_for(connect(s.url, user="tierflow", password="wrong"), 15)
        with pytest.raises(nats.errors.AuthorizationError):
            await asyncio.wait_for(connect(s.url), 15)

        # the same through an endpoint; keywords given to its connect win
        ep = NatsEndpoint(s.url, user="tierflow", password="s3cret$#x", name="ep-default")
        nc = await ep.connect(name="ep-given")
        try:
            status, connz = s.monitor("connz")
            assert status == 200 and [c["name"] for c in connz["connections"]] == ["ep-given"]
        finally:
            await nc.close()


@pytest.mark.unit
def test_endpoint_from_config_names_the_role_its_credentials_and_tls(tmp_path: Path) -> None:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path),
            "nats": {
                "url": "nats://nats.example:4222",
                "tls_ca": "/etc/ca.pem",
                "users": {"analysis": {"user": "tf-analysis", "password": "pw"}},
            },
        },
    )
    ep = NatsEndpoint.from_config(cfg, "analysis", name="spark")
    assert (ep.url, ep.user, ep.password, ep.name) == (
        "nats://nats.example:4222",
        "tf-analysis",
        "pw",
        "spark",
    )
    assert (ep.tls_ca, ep.tls_cert, ep.tls_key) == ("/etc/ca.pem", None, None)
    assert "pw" not in repr(ep)
    shared = NatsEndpoint.from_config(cfg, url="nats://other:4222")  # admin: the shared ones
    assert (shared.url, shared.user, shared.password) == ("nats://other:4222", None, None)
    assert shared.named("probe") == NatsEndpoint(
        "nats://other:4222", tls_ca="/etc/ca.pem", name="probe"
    )
    with pytest.raises(ValueError, match="unknown NATS role"):
        NatsEndpoint.from_config(cfg, "nobody")

    make_dev_certs(tmp_path / "certs")
    tls = load(
        environ={},
        overrides={"state_dir": str(tmp_path), "tls": {"enabled": True, "verify_clients": True}},
    )
    ep = NatsEndpoint.from_config(tls, "analysis")
    certs = tmp_path.resolve() / "certs"
    assert ep.tls_ca == str(certs / "ca.pem") and ep.tls_cert and ep.tls_key
    kw = ep.connect_kwargs()
    assert kw["servers"] == "" and kw["user"] is None  # no nats.url: the caller gives one
    ctx = kw["tls"]
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert "tls" not in NatsEndpoint("nats://plain:4222").connect_kwargs()


@pytest.mark.unit
async def test_connect_unreachable_fails_fast() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(nats.errors.NoServersError):
        await asyncio.wait_for(connect(url, connect_attempts=2), 15)
