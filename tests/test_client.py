"""The Python client: resumable subscriptions and exactly-once processing (book ch. 8).

Unit tests run the client against `FakeGateway`, the WS protocol over an in-memory log that
can misbehave on purpose (drop connections, re-send what was delivered, refuse). The
acceptance tests at the bottom run against the real Gateway over a real nats-server: a
failover between two gateways, and the royalty example with a SIGKILLed client process.

Run as a script (`python tests/test_client.py royalty ...`) this file is the royalty payer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web

from actors.access.client import (
    Delivery,
    ExactlyOnce,
    GatewayError,
    GatewayUnavailable,
    TierflowClient,
    resume_frame_from,
    ws_url,
)
from runtime.config import Config, load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect, free_port
from runtime.state.checkpoint import Batch, CheckpointStore
from runtime.waiting import await_until

# --------------------------------------------------------------------------- fake gateway


class FakeGateway:
    """The gateway WS protocol over a shared in-memory log (seq = index + 1).

    `close_every` closes each connection after that many events (a crash, as the client sees
    it); `overlap` makes a resubscription from seq N start at N - overlap (a sloppy server
    re-sending what the client had); `refuse` answers every subscribe with an error frame or,
    if >= 4000, a close code; `notices` are frames sent after `subscribed`.
    """

    def __init__(
        self,
        log: list[tuple[str, Any]],
        changed: asyncio.Condition,
        *,
        close_every: int | None = None,
        overlap: int = 0,
        refuse: int | None = None,
        token: str | None = None,
        notices: tuple[dict[str, Any], ...] = (),
        hello: dict[str, Any] | None = None,
    ) -> None:
        self.log, self.changed = log, changed
        self.close_every, self.overlap, self.refuse = close_every, overlap, refuse
        self.token, self.notices, self.hello = token, notices, hello or {}
        self.subscribes: list[dict[str, Any]] = []
        self.acks: list[int] = []
        self.slow_downs: list[float] = []
        self.sockets: set[web.WebSocketResponse] = set()
        self.port = 0  # bound by start: the kernel's choice, so no other process can take it
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeGateway:
        app = web.Application()
        app.router.add_get("/v1/ws", self._ws)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        for ws in list(self.sockets):
            await ws.close(code=1001)
        async with self.changed:
            self.changed.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()

    def _start_seq(self, start: Any) -> int:
        if start == "all":
            return 1
        if start == "new":
            return len(self.log) + 1
        return max(1, int(start) - self.overlap)

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.Response(status=401, text="missing or invalid token")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.add(ws)
        try:
            frame = await ws.receive_json(timeout=5)
            self.subscribes.append(frame)
            sid = frame["id"]
            if self.refuse is not None and self.refuse >= 4000:
                await ws.close(code=self.refuse)
                return ws
            if self.refuse is not None:
                await ws.send_json({"op": "error", "id": sid, "code": self.refuse, "reason": "no"})
                await ws.close(code=4000 + self.refuse)
                return ws
            seq = self._start_seq(frame["from"])
            hello = {"op": "subscribed", "id": sid, "stream": "s", "from_seq": seq}
            await ws.send_json({**hello, **self.hello})
            for notice in self.notices:
                await ws.send_json({**notice, "id": sid})
            reader = asyncio.create_task(self._read_acks(ws))
            sent = 0
            while not ws.closed and (self.close_every is None or sent < self.close_every):
                async with self.changed:
                    await asyncio.wait_for(
                        self.changed.wait_for(lambda s=seq: len(self.log) >= s or ws.closed), 10
                    )
                if ws.closed:
                    break
                subject, data = self.log[seq - 1]
                await ws.send_json(
                    {"op": "event", "id": sid, "seq": seq, "subject": subject, "data": data}
                )
                seq, sent = seq + 1, sent + 1
            await ws.close(code=1011)
            reader.cancel()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            self.sockets.discard(ws)
        return ws

    async def _read_acks(self, ws: web.WebSocketResponse) -> None:
        async for msg in ws:
            frame = msgspec.json.decode(msg.data)
            if frame.get("op") == "ack":
                self.acks.append(frame["seq"])
            elif frame.get("op") == "slow_down":
                self.slow_downs.append(frame["max_rate"])


@pytest.fixture
async def fake_log() -> tuple[list[tuple[str, Any]], asyncio.Condition]:
    return [], asyncio.Condition()


async def append(shared: tuple[list[tuple[str, Any]], asyncio.Condition], n: int) -> None:
    log, changed = shared
    async with changed:
        for _ in range(n):
            log.append(("plays.x", {"n": len(log) + 1}))
        changed.notify_all()


@contextlib.asynccontextmanager
async def gateway(
    shared: tuple[list[tuple[str, Any]], asyncio.Condition], **kw: Any
) -> AsyncIterator[FakeGateway]:
    gw = await FakeGateway(*shared, **kw).start()
    try:
        yield gw
    finally:
        await gw.stop()


async def take(it: AsyncIterator[Delivery], n: int, timeout: float = 20) -> list[Delivery]:
    async def run() -> list[Delivery]:
        return [await anext(it) for _ in range(n)]

    return await asyncio.wait_for(run(), timeout)


# --------------------------------------------------------------------------- pure parts


@pytest.mark.unit
def test_ws_url_accepts_base_and_ws_urls() -> None:
    assert ws_url("http://127.0.0.1:8080") == "ws://127.0.0.1:8080/v1/ws"
    assert ws_url("https://gw.example/") == "wss://gw.example/v1/ws"
    assert ws_url("ws://h:1/custom?x=1") == "ws://h:1/custom?x=1"
    with pytest.raises(ValueError, match="http"):
        ws_url("nats://h:4222")


@pytest.mark.unit
def test_resume_position_prefers_own_last_seq() -> None:
    assert resume_frame_from("new", None, 0) == "new"
    assert resume_frame_from("new", 42, 0) == 42  # nothing delivered yet: where "new" began
    assert resume_frame_from("all", 1, 17) == 18  # after the last delivery, never before
    assert resume_frame_from(5, 5, 0) == 5


# --------------------------------------------------------------------------- subscribe


@pytest.mark.unit
async def test_subscribe_all_in_order(fake_log: Any) -> None:
    await append(fake_log, 30)
    async with gateway(fake_log) as gw, TierflowClient(gw.url) as client:
        got = await take(client.subscribe("plays", start="all"), 30)
    assert [d.seq for d in got] == list(range(1, 31))
    assert got[0] == Delivery(1, "plays.x", {"n": 1}, "plays")


@pytest.mark.unit
async def test_reconnects_resume_without_gap_or_duplicate(fake_log: Any) -> None:
    """Connections die every 7 events and the server re-sends 3 already delivered ones on
    every resume: the client still sees each seq exactly once, in order."""
    await append(fake_log, 100)
    async with (
        gateway(fake_log, close_every=7, overlap=3) as gw,
        TierflowClient(gw.url, rng=random.Random(1)) as client,
    ):
        got = await take(client.subscribe("plays", start="all", client_id="c1", sub_id="s1"), 100)
    assert [d.seq for d in got] == list(range(1, 101))
    assert client.stats.reconnects >= 100 // 7
    assert client.stats.duplicates > 0  # the overlap really was re-sent and dropped
    resumes = [f["from"] for f in gw.subscribes[1:]]
    assert resumes[:3] == [8, 12, 16]  # right after the last delivery (7 sent, 3 old)
    assert {(f["client"], f["id"]) for f in gw.subscribes} == {("c1", "s1")}


@pytest.mark.unit
async def test_new_subscription_keeps_what_arrived_while_disconnected(fake_log: Any) -> None:
    """ "new" is pinned to the server's from_seq, so events published between a drop and the
    reconnect are not skipped even when nothing had been delivered yet."""
    await append(fake_log, 10)
    async with (
        gateway(fake_log, close_every=0) as a,  # hangs up right after "subscribed"
        gateway(fake_log) as b,
        TierflowClient([a.url, b.url]) as client,
    ):
        it = client.subscribe("plays", start="new")
        first = asyncio.ensure_future(anext(it))
        await await_until(lambda: a.subscribes, 10, what="subscribed to a")
        await append(fake_log, 5)
        got = [await asyncio.wait_for(first, 10), *await take(it, 4)]
    assert [d.seq for d in got] == [11, 12, 13, 14, 15]
    assert a.subscribes[0]["from"] == "new" and b.subscribes[0]["from"] == 11


@pytest.mark.unit
async def test_fails_over_to_the_next_gateway(fake_log: Any) -> None:
    await append(fake_log, 20)
    async with (
        gateway(fake_log) as a,
        gateway(fake_log) as b,
        TierflowClient([a.url, b.url]) as client,
    ):
        it = client.subscribe("plays", start="all")
        got = await take(it, 20)
        await a.stop()
        await append(fake_log, 20)
        got += await take(it, 20)
    assert [d.seq for d in got] == list(range(1, 41))
    assert b.subscribes and b.subscribes[0]["from"] == 21


@pytest.mark.unit
async def test_acks_follow_processing(fake_log: Any) -> None:
    await append(fake_log, 10)
    async with gateway(fake_log) as gw, TierflowClient(gw.url) as client:
        it = client.subscribe("plays", start="all", ack=True)
        await take(it, 6)  # asking for the 6th means the 5th was processed
        await await_until(lambda: gw.acks == [1, 2, 3, 4, 5], 10, what="acks 1..5")
    assert gw.subscribes[0]["ack"] is True


@pytest.mark.unit
async def test_slow_down_is_requested(fake_log: Any) -> None:
    await append(fake_log, 2)
    async with gateway(fake_log) as gw, TierflowClient(gw.url) as client:
        await take(client.subscribe("plays", start="all", max_rate=50.0), 2)
        await await_until(lambda: gw.slow_downs == [50.0], 10, what="slow_down sent")


@pytest.mark.unit
async def test_lag_and_losses_are_reported(fake_log: Any) -> None:
    await append(fake_log, 3)
    notices: list[dict[str, Any]] = []
    lag = {"op": "lag", "behind": 5000, "policy": "drop_oldest"}
    dropped = {"op": "dropped", "count": 7}
    async with (
        gateway(fake_log, notices=(lag, dropped), hello={"gap": 4}) as gw,
        TierflowClient(gw.url, on_notice=notices.append) as client,
    ):
        await take(client.subscribe("plays", start="all"), 3)
    assert [n["op"] for n in notices] == ["subscribed", "lag", "dropped"]
    assert client.stats.lag_warnings == 1 and client.stats.dropped == 7
    assert client.stats.aged_out == 4
    assert client.stats.last_lag is not None and client.stats.last_lag["behind"] == 5000


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"token": "right"}, 401),
        ({"refuse": 404}, 404),
        ({"refuse": 4403}, 403),
        ({"refuse": 410}, 410),  # a named cursor that does not exist: retrying cannot help
    ],
)
async def test_refusals_are_not_retried(fake_log: Any, kw: dict[str, Any], code: int) -> None:
    async with gateway(fake_log, **kw) as gw, TierflowClient(gw.url, token="wrong") as client:
        with pytest.raises(GatewayError) as err:
            await take(client.subscribe("plays"), 1)
    assert err.value.code == code
    assert client.stats.reconnects == 0


@pytest.mark.unit
async def test_gives_up_when_no_gateway_answers() -> None:
    client = TierflowClient(f"http://127.0.0.1:{free_port()}", give_up_after=0.3)
    async with client:
        with pytest.raises(GatewayUnavailable):
            await take(client.subscribe("plays"), 1)
    assert client.stats.reconnects >= 1


@pytest.mark.unit
async def test_token_is_sent_as_bearer(fake_log: Any) -> None:
    await append(fake_log, 1)
    async with (
        gateway(fake_log, token="s3cret") as gw,
        TierflowClient(gw.url, token="s3cret") as client,
    ):
        assert [d.seq for d in await take(client.subscribe("plays", start="all"), 1)] == [1]


# --------------------------------------------------------------------------- exactly once


def _pay(delivery: Delivery, batch: Batch) -> None:
    batch.put("ledger", str(delivery.data["n"]).encode(), b"1")


@pytest.mark.unit
async def test_exactly_once_skips_processed_ids(tmp_path: Path) -> None:
    d = Delivery(3, "plays.x", {"n": 3}, "plays")
    with ExactlyOnce(tmp_path / "eo") as eo:
        assert await eo.process(d, _pay) is True
        assert await eo.process(d, _pay) is False
        assert eo.resume_from("plays") == 4 and eo.resume_from("other") == "all"
    with ExactlyOnce(tmp_path / "eo") as eo:  # durable across a reopen
        assert eo.processed(d) and await eo.process(d, _pay) is False
        assert eo.store.namespace("ledger").count() == 1


@pytest.mark.unit
async def test_a_failing_handler_records_nothing(tmp_path: Path) -> None:
    d = Delivery(1, "plays.x", {"n": 1}, "plays")

    async def boom(delivery: Delivery, batch: Batch) -> None:
        _pay(delivery, batch)
        raise RuntimeError("third party down")

    with ExactlyOnce(tmp_path / "eo") as eo:
        with pytest.raises(RuntimeError):
            await eo.process(d, boom)
        assert not eo.processed(d) and eo.store.namespace("ledger").count() == 0
        assert eo.last_seq("plays") == 0
        assert await eo.process(d, _pay) is True  # the retry pays, once


@pytest.mark.unit
async def test_key_absorbs_producer_duplicates(tmp_path: Path) -> None:
    """Keyed by the producer's id, the same play published twice (two seqs) pays once."""
    with ExactlyOnce(tmp_path / "eo", key=lambda d: d.data["play_id"]) as eo:
        ran = [
            await eo.process(Delivery(seq, "plays.x", {"play_id": "p1", "n": seq}, "plays"), _pay)
            for seq in (1, 2)
        ]
    assert ran == [True, False]


# --------------------------------------------------------------------------- royalty payer


def royalty_key(delivery: Delivery) -> str:
    return str(delivery.data["play_id"])


def pay_royalty(store: CheckpointStore) -> Callable[[Delivery, Batch], None]:
    """The payer's state change: append a ledger entry and bump the artist's balance, all in
    the batch ExactlyOnce commits with the processed mark."""
    meta, ledger, balances = (store.namespace(n) for n in ("meta", "ledger", "balances"))

    def pay(delivery: Delivery, batch: Batch) -> None:
        entry = int(meta.get(b"next_entry", b"0"))
        artist = delivery.data["artist"].encode()
        cents = delivery.data["cents"]
        batch.put(ledger, b"%012d" % entry, msgspec.json.encode(delivery.data))
        batch.put(balances, artist, b"%d" % (int(balances.get(artist, b"0")) + cents))
        batch.put(meta, b"next_entry", b"%d" % (entry + 1))
        if os.environ.get("ROYALTY_CRASH_IN_HANDLER") == delivery.data["play_id"]:
            os._exit(9)  # after handling, before the batch commits: nothing may survive

    return pay


async def royalty_main(url: str, store: str, start: str, expected: int, token: str) -> None:
    """Pay each play once; print progress; exit when `expected` distinct plays are paid."""
    crash_after = os.environ.get("ROYALTY_CRASH_AFTER_COMMIT")
    with ExactlyOnce(store, key=royalty_key) as eo:
        pay = pay_royalty(eo.store)
        first: Any = eo.resume_from("plays") if start == "resume" else start
        done = eo.store.namespace("ledger").count()
        print(f"start {first} paid {done}", flush=True)
        async with TierflowClient(url, token=token or None) as client:
            async for d in client.subscribe("plays", start=first, client_id="royalty-payer"):
                if await eo.process(d, pay):
                    done += 1
                    print(f"paid {done} {d.data['play_id']} seq {d.seq}", flush=True)
                else:
                    print(f"skip {d.data['play_id']} seq {d.seq}", flush=True)
                if crash_after == d.data["play_id"]:
                    os._exit(9)  # committed, not yet moved on: a redelivery must be skipped
                if done >= expected:
                    return


# --------------------------------------------------------------------------- real gateway

NS = "tf-client"
TOKEN = "client-token"
PLAYS = 400
RESENT = 10  # plays a sloppy producer publishes twice (new Nats-Msg-Id, so stored twice)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> Config:
    return load(
        environ={},
        overrides={
            "state_dir": str(tmp_path_factory.mktemp("state")),
            "ray": {"namespace": NS},
            "auth": {"consumer_tokens": [TOKEN]},
            "streams": {"plays": {"subjects": ["plays.>"]}, "feed": {"subjects": ["feed.>"]}},
        },
    )


@pytest.fixture(scope="module")
async def real_gateway(ray_module: Any, nats_server: NatsServer, cfg: Config) -> AsyncIterator[str]:
    """Two real Gateway replicas (supervised Ray actors) sharing one port (SO_REUSEPORT)."""
    from cluster.deploy.gateway import start_gateways, stop_gateways

    nc = await connect(nats_server.url)
    await ensure_streams(nc, cfg)
    await nc.close()
    names = await asyncio.to_thread(start_gateways, cfg, nats_server.url, 2, 0)
    ends = ray_module.get(ray_module.get_actor(names[0], namespace=NS).endpoints.remote())
    yield ends["url"]
    await asyncio.to_thread(stop_gateways, cfg, names)


async def publish_paced(
    nats_url: str, items: list[tuple[str, str, bytes]], per_tick: int = 20, tick_s: float = 0.05
) -> None:
    """(subject, msg id, payload) at a steady pace, so consumers are mid-stream meanwhile."""
    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        for i in range(0, len(items), per_tick):
            for subject, msg_id, payload in items[i : i + per_tick]:
                await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
            await asyncio.sleep(tick_s)  # pacing the producer, not waiting for a condition
    finally:
        await nc.close()


async def serving_replica(ray: Any) -> int:
    """The pid of the gateway replica holding our one WebSocket."""

    async def find() -> int | None:
        for name in ("gateway-0", "gateway-1"):
            actor = ray.get_actor(name, namespace=NS)
            stats = await asyncio.to_thread(ray.get, actor.stats.remote(), timeout=30)
            if stats["open"]["ws"] > 0:
                return int(stats["pid"])
        return None

    return await await_until(find, 30, what="a replica with our connection")


async def test_real_gateway_failover_has_no_gap_and_no_repeat(
    real_gateway: str, nats_server: NatsServer, ray_module: Any
) -> None:
    """SIGKILL the replica serving the client mid-stream: the client reconnects (the other
    replica takes the port) and resumes after its last seq."""
    n = 600
    items = [("feed.x", f"f-{i}", msgspec.json.encode({"i": i})) for i in range(1, n + 1)]
    producing = asyncio.ensure_future(publish_paced(nats_server.url, items))
    async with TierflowClient(real_gateway, token=TOKEN) as client:
        it = client.subscribe("feed", start="all", client_id="failover", sub_id="feed-1")
        got = await take(it, 100, timeout=60)
        os.kill(await serving_replica(ray_module), signal.SIGKILL)
        got += await take(it, n - 100, timeout=90)
        await producing
    assert [d.seq for d in got] == list(range(1, n + 1))
    assert [d.data["i"] for d in got] == list(range(1, n + 1))
    assert client.stats.reconnects >= 1


def plays() -> list[dict[str, Any]]:
    rng = random.Random(11)
    artists = [f"artist-{a}" for a in range(12)]
    return [
        {"play_id": f"play-{i:06d}", "artist": rng.choice(artists), "cents": rng.randint(1, 5)}
        for i in range(1, PLAYS + 1)
    ]


class Payer:
    """The royalty payer as a child process whose progress lines we read."""

    def __init__(self, url: str, store: Path, start: str, env: dict[str, str]) -> None:
        self.args = [sys.executable, __file__, "royalty", url, str(store), start, str(PLAYS)]
        self.env = {**os.environ, **env}
        self.paid = 0
        self.skipped = 0

    async def __aenter__(self) -> Payer:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, TOKEN, stdout=asyncio.subprocess.PIPE, env=self.env
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await asyncio.wait_for(self.proc.wait(), 30)

    async def until_paid(self, n: int, timeout: float = 60) -> None:
        """Read progress until `n` plays are paid in total (or the process ends)."""

        async def read() -> None:
            assert self.proc.stdout is not None
            while self.paid < n:
                line = await self.proc.stdout.readline()
                if not line:
                    return
                if line.startswith(b"paid "):
                    self.paid = int(line.split()[1])
                elif line.startswith(b"skip "):
                    self.skipped += 1

        await asyncio.wait_for(read(), timeout)

    async def exit_code(self, timeout: float = 60) -> int:
        await self.until_paid(PLAYS + 1, timeout)  # drain the output to the end
        return await asyncio.wait_for(self.proc.wait(), timeout)


async def test_royalties_are_paid_exactly_once_across_crashes(
    real_gateway: str, nats_server: NatsServer, tmp_path: Path
) -> None:
    """The book's royalty example: the payer is killed five ways mid-stream and restarted;
    in the end every play is paid exactly once."""
    catalog = plays()
    items = [("plays.song", p["play_id"], msgspec.json.encode(p)) for p in catalog]
    items += [
        ("plays.song", f"{p['play_id']}-again", msgspec.json.encode(p)) for p in catalog[:RESENT]
    ]
    producing = asyncio.ensure_future(publish_paced(nats_server.url, items, tick_s=0.1))
    store = tmp_path / "royalties"

    crash_in = {"ROYALTY_CRASH_IN_HANDLER": "play-000060"}  # handled, not yet committed
    async with Payer(real_gateway, store, "all", crash_in) as payer:
        assert await payer.exit_code() == 9 and payer.paid == 59
    async with Payer(real_gateway, store, "resume", {}) as payer:  # SIGKILLed mid-stream
        await payer.until_paid(140)
        payer.proc.send_signal(signal.SIGKILL)
        assert await payer.exit_code() == -signal.SIGKILL
    crash_after = {"ROYALTY_CRASH_AFTER_COMMIT": "play-000200"}  # committed, then gone
    async with Payer(real_gateway, store, "resume", crash_after) as payer:
        assert await payer.exit_code() == 9 and payer.paid >= 200
    async with Payer(real_gateway, store, "all", {}) as payer:  # re-reads all: skips paid
        await payer.until_paid(260)
        payer.proc.send_signal(signal.SIGKILL)
        await payer.exit_code()
        assert payer.skipped >= 200  # every play paid before came again and was skipped
    async with Payer(real_gateway, store, "resume", {}) as payer:
        assert await payer.exit_code(timeout=120) == 0 and payer.paid == PLAYS
    await producing

    with CheckpointStore(store) as db:
        ledger = [msgspec.json.decode(v) for _, v in db.namespace("ledger").scan()]
        balances = {k.decode(): int(v) for k, v in db.namespace("balances").scan()}
    paid_ids = [e["play_id"] for e in ledger]
    assert len(paid_ids) == len(set(paid_ids)) == PLAYS  # nothing paid twice
    assert set(paid_ids) == {p["play_id"] for p in catalog}  # nothing lost
    owed: Counter[str] = Counter()
    for p in catalog:
        owed[p["artist"]] += p["cents"]
    assert balances == dict(owed)


if __name__ == "__main__" and sys.argv[1:2] == ["royalty"]:
    _url, _store, _start, _expected, _token = sys.argv[2:7]
    asyncio.run(royalty_main(_url, _store, _start, int(_expected), _token))
