"""Security: TLS everywhere it is asked for, per-role NATS users, tokens, encryption at rest.

Real nats-server (TLS, users with subject permissions, JetStream cipher), real Ray for
the collector and the gateway, real HTTP clients. Refusals are checked where they matter:
a refused request or a forbidden publish never changes the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats.errors
import pytest
import pytest_asyncio
from typer.testing import CliRunner

from cluster.replay import ReplayServer
from cluster.verify import stream_ids
from runtime.certs import make_dev_certs, server_names
from runtime.config import Config, ConfigError, load
from runtime.engines.services import connect_nats, ensure_streams
from runtime.loop_thread import LoopThread
from runtime.nats.roles import credentials, role_permissions, secrets_path
from runtime.nats.server import NatsEndpoint, NatsServer, connect
from runtime.tls import client_ssl_context, server_ssl_context
from runtime.waiting import await_until
from tests.support import NatsFactory, start_on_free_port

NS = "tf-security"
PRODUCER_TOKEN = "prod-S3CRET-7f1c"
CONSUMER_TOKEN = "cons-S3CRET-9a2e"
JS_KEY = "jskey-S3CRET-4b8d0c1e"
MARKER = b"PLAINTEXT-MARKER-5d7e"
STREAMS = {
    "guarded": {"subjects": ["raw.guarded"]},
    "results": {"subjects": ["results.>"]},
    "deadletter": {"subjects": ["deadletter.>"]},
}
SOURCED_EVENTS = 60  # what the replay server sends to the stream-pattern stream `sourced`


def secured_config(state: Path, **over: Any) -> Config:
    base: dict[str, Any] = {
        "state_dir": str(state),
        "ray": {"namespace": NS},
        "roles": {"logger": {"k": 0}, "collector": {"port": 0}},
        "tls": {"enabled": True},
        "nats": {"role_users": True, "encryption_key": JS_KEY},
        "auth": {"producer_tokens": [PRODUCER_TOKEN], "consumer_tokens": [CONSUMER_TOKEN]},
        "streams": STREAMS,
    }
    base.update(over)
    return load(environ={}, overrides=base)


@pytest.fixture(scope="module")
def replay() -> Iterator[ReplayServer]:
    """A stream-pattern source, on its own loop so it serves between tests too."""
    server = ReplayServer(11, rate=200.0, count=SOURCED_EVENTS)

    async def serve(stop: asyncio.Event, ready: Callable[[], None]) -> None:
        await server.start()
        ready()
        await stop.wait()
        await server.stop()

    thread = LoopThread("security-replay")
    thread.start(serve)
    yield server
    thread.stop()


@pytest.fixture(scope="module")
def secured(
    nats_factory: NatsFactory, tmp_path_factory: pytest.TempPathFactory, replay: ReplayServer
) -> Iterator[tuple[Config, NatsServer]]:
    """An embedded server as `tierflow up` starts it with every security option on."""
    state = tmp_path_factory.mktemp("secured")
    make_dev_certs(state / "certs")
    source = {"url": replay.stream_url, "kind": "ws", "k": 0}
    cfg = secured_config(state, streams={**STREAMS, "sourced": {"source": source}})
    with nats_factory.from_config(cfg) as server:
        yield cfg, server


@pytest_asyncio.fixture(scope="module")
async def admin_js(secured: tuple[Config, NatsServer]) -> AsyncIterator[Any]:
    cfg, server = secured
    nc = await connect_nats(cfg, server.url, role="admin")
    await ensure_streams(nc, cfg)
    yield nc.jetstream()
    await nc.close()


async def as_role(cfg: Config, server: NatsServer, role: str, errors: list[Exception]) -> Any:
    """A client with `role`'s credentials that records the server's async errors."""
    who = credentials(cfg, role)

    async def on_error(e: Exception) -> None:
        errors.append(e)

    return await connect(
        server.url,
        user=who.user,
        password=who.password,
        tls=client_ssl_context(cfg),
        error_cb=on_error,
        name=f"test-{role}",
    )


async def refused(nc: Any, errors: list[Exception], verb: str, subject: str) -> None:
    """The server reported a permissions violation for `verb` on `subject`."""
    await nc.flush()
    want = f'permissions violation for {verb} to "{subject}"'
    await await_until(
        lambda: any(want.lower() in str(e).lower() for e in errors), timeout=10, what=want
    )


async def count(js: Any, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


# --------------------------------------------------------------------------- certificates


@pytest.mark.unit
def test_dev_certs_are_a_working_chain_with_private_keys(tmp_path: Path) -> None:
    certs = make_dev_certs(tmp_path / "c", ["tierflow.test", "10.1.2.3"])
    assert set(server_names(certs.cert)) >= {"127.0.0.1", "localhost", "tierflow.test", "10.1.2.3"}
    for key in (certs.key, certs.ca_key, certs.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(certs.dir.stat().st_mode) == 0o700
    # the server certificate verifies against the CA for its names, the client's too
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(certs.cert, certs.key)
    ca_before = certs.ca.read_bytes()
    again = make_dev_certs(tmp_path / "c", ["other.test"])  # a rerun keeps the CA
    assert again.ca.read_bytes() == ca_before
    assert "other.test" in server_names(again.cert)


@pytest.mark.unit
def test_cli_certs_writes_where_tls_looks_and_prints_no_key(tmp_path: Path) -> None:
    from cluster.cli import app

    env = {"TIERFLOW_STATE_DIR": str(tmp_path / "state")}
    out = CliRunner().invoke(app, ["certs", "--name", "gw.example"], env=env)
    assert out.exit_code == 0, out.output
    assert "PRIVATE KEY" not in out.output
    cfg = load(environ={**env, "TIERFLOW_TLS__ENABLED": "true"})
    assert server_ssl_context(cfg) is not None and client_ssl_context(cfg) is not None
    assert "gw.example" in server_names(tmp_path / "state" / "certs" / "server.pem")


@pytest.mark.unit
def test_tls_on_without_certificates_says_how_to_make_them(tmp_path: Path) -> None:
    cfg = load(environ={}, overrides={"state_dir": str(tmp_path), "tls": {"enabled": True}})
    with pytest.raises(ConfigError, match="tierflow certs"):
        server_ssl_context(cfg)
    plain = load(environ={}, overrides={"state_dir": str(tmp_path)})
    assert server_ssl_context(plain) is None and client_ssl_context(plain) is None


# --------------------------------------------------------------------------- secrets and admin


@pytest.mark.unit
def test_config_show_and_repr_never_reveal_secrets(tmp_path: Path) -> None:
    from cluster.cli import app

    secrets = [PRODUCER_TOKEN, CONSUMER_TOKEN, JS_KEY, "natsPW-S3CRET", "urlPW-S3CRET"]
    env = {
        "TIERFLOW_STATE_DIR": str(tmp_path),
        "TIERFLOW_AUTH__PRODUCER_TOKENS": f'["{PRODUCER_TOKEN}"]',
        "TIERFLOW_AUTH__CONSUMER_TOKENS": f'["{CONSUMER_TOKEN}"]',
        "TIERFLOW_AUTH__CONSUMER_STREAMS": f'{{"{CONSUMER_TOKEN}" = ["results"]}}',
        "TIERFLOW_NATS__USER": "me",
        "TIERFLOW_NATS__PASSWORD": "natsPW-S3CRET",
        "TIERFLOW_NATS__USERS": '{gateway = {user = "gw", password = "natsPW-S3CRET"}}',
    }
    runner = CliRunner()
    for args in (["config", "show"], ["config", "show", "--json"]):
        out = runner.invoke(app, args, env=env)
        assert out.exit_code == 0, out.output
        assert "<redacted>" in out.output
        assert not [s for s in secrets if s in out.output], out.output
    cfg = load(
        environ=env,
        overrides={
            "nats": {"url": "nats://me:urlPW-S3CRET@127.0.0.1:4222", "encryption_key": ""},
        },
    )
    text = repr(cfg) + str(cfg)
    assert not [s for s in secrets if s in text]
    assert "user='me'" in text and "<redacted>" in text  # names stay, secrets go


@pytest.mark.unit
@pytest.mark.parametrize(
    ("nats", "match"),
    [
        ({"url": "nats://h:4222", "encryption_key": "k"}, "only for the embedded server"),
        ({"users": {"gateway": {}}}, "nats.users.gateway"),
        ({"url": "nats://h:4222", "users": {"gateway": {"user": "gw"}}}, "password"),
        ({"users": {"nobody": {"user": "x", "password": "y"}}}, "nats.users"),
        ({"encryption_cipher": "rot13"}, "encryption_cipher"),
    ],
)
def test_security_settings_are_checked_at_load(nats: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load(environ={}, overrides={"nats": nats})
    # with the embedded server and role_users, a name alone is fine: the password is made
    load(environ={}, overrides={"nats": {"role_users": True, "users": {"bridge": {"user": "b"}}}})


@pytest.mark.unit
def test_admin_binds_loopback_unless_configured(tmp_path: Path) -> None:
    assert load(environ={}).admin.host == "127.0.0.1"
    assert load(environ={"TIERFLOW_ADMIN__HOST": "0.0.0.0"}).admin.host == "0.0.0.0"
    assert load(environ={}, overrides={"admin": {"host": "::1"}}).admin.host == "::1"


@pytest.mark.unit
async def test_admin_endpoint_loopback_and_https_only_with_tls(tmp_path: Path) -> None:
    from cluster.admin import serve

    make_dev_certs(tmp_path / "certs")
    cfg = load(environ={}, overrides={"state_dir": str(tmp_path), "tls": {"enabled": True}})

    async def status() -> dict[str, Any]:
        return {"uptime_s": 1}

    runner, port = await serve(
        status, cfg.admin.host, cfg.admin.port, ssl_context=server_ssl_context(cfg)
    )
    try:
        assert runner.addresses[0][0] == "127.0.0.1"
        ssl_ctx = client_ssl_context(cfg)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"https://127.0.0.1:{port}/status", ssl=ssl_ctx) as r:
                assert r.status == 200 and (await r.json()) == {"uptime_s": 1}
            with pytest.raises(aiohttp.ClientError):
                async with s.get(f"http://127.0.0.1:{port}/status") as r:
                    await r.read()
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with s.get(f"https://127.0.0.1:{port}/status") as r:  # no dev CA
                    await r.read()
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- NATS: TLS


def plain_nats_handshake(port: int, timeout: float = 5.0) -> bytes:
    """Speak plain NATS (no TLS upgrade) to `port`; everything the server said back."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        got += sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        try:
            while chunk := sock.recv(4096):
                got += chunk
                if b"PONG" in got:
                    break
        except (TimeoutError, ConnectionResetError):
            pass
    return got


async def test_nats_with_tls_refuses_plain_clients(
    secured: tuple[Config, NatsServer], admin_js: Any
) -> None:
    cfg, server = secured
    said = plain_nats_handshake(server.port)
    assert b'"tls_required":true' in said and b"PONG" not in said
    nc = await connect_nats(cfg, server.url, name="tls-probe", role="admin")
    try:
        status, connz = server.monitor("connz?auth=1")
        mine = [c for c in connz["connections"] if c.get("name") == "tls-probe"]
        assert status == 200 and mine[0]["tls_version"].startswith("1.")  # really over TLS
        assert mine[0]["authorized_user"] == "tierflow-admin"
    finally:
        await nc.close()


# --------------------------------------------------------------------------- NATS: role users


async def test_each_role_may_do_its_job_and_nothing_else(
    secured: tuple[Config, NatsServer], admin_js: Any
) -> None:
    cfg, server = secured
    before = await count(admin_js, "guarded")

    # bridge: publishes to stream subjects
    errs: list[Exception] = []
    bridge = await as_role(cfg, server, "bridge", errs)
    ack = await bridge.jetstream().publish("raw.guarded", b'{"by":"bridge"}')
    assert ack.stream == "guarded"
    await bridge.subscribe("raw.>")
    await refused(bridge, errs, "subscription", "raw.>")
    await bridge.close()

    # gateway: reads streams, may not write them nor listen to producers
    errs = []
    gw = await as_role(cfg, server, "gateway", errs)
    gjs = gw.jetstream()
    assert await count(gjs, "guarded") == before + 1
    assert (await gjs.get_msg("guarded", ack.seq)).data == b'{"by":"bridge"}'
    psub = await gjs.pull_subscribe("raw.guarded", stream="guarded")
    assert [m.data for m in await psub.fetch(1, timeout=5)] == [b'{"by":"bridge"}']
    await gw.publish("raw.guarded", b'{"by":"gateway"}')
    await refused(gw, errs, "publish", "raw.guarded")
    await gw.subscribe("ingest.*")
    await refused(gw, errs, "subscription", "ingest.*")
    await gw.close()

    # collector: serves `ingest.*`, may not publish to a stream or read results directly
    errs = []
    col = await as_role(cfg, server, "collector", errs)
    await col.subscribe("ingest.*", queue="collectors")
    await col.publish("raw.guarded", b"{}")
    await refused(col, errs, "publish", "raw.guarded")
    await col.subscribe("results.>")
    await refused(col, errs, "subscription", "results.>")
    await col.close()

    # analysis: writes results, not raw events; producer: only ingest requests
    errs = []
    ana = await as_role(cfg, server, "analysis", errs)
    assert (await ana.jetstream().publish("results.top", b"{}")).stream == "results"
    await ana.publish("raw.guarded", b"{}")
    await refused(ana, errs, "publish", "raw.guarded")
    await ana.close()
    errs = []
    prod = await as_role(cfg, server, "producer", errs)
    await prod.publish("raw.guarded", b"{}")
    await refused(prod, errs, "publish", "raw.guarded")
    await prod.close()

    assert await count(admin_js, "guarded") == before + 1  # only the bridge's message


async def test_bridge_cannot_publish_results_nor_the_collector_read_them(
    secured: tuple[Config, NatsServer], admin_js: Any
) -> None:
    """System streams are the runtime's: the bridge (which publishes what producers sent)
    may not write `results.>`, and the collector may read neither `results` nor the
    webhook bucket (only its buffer)."""
    cfg, server = secured
    results_before = await count(admin_js, "results")
    errs: list[Exception] = []
    bridge = await as_role(cfg, server, "bridge", errs)
    await bridge.publish("results.x", b'{"forged": true}')
    await refused(bridge, errs, "publish", "results.x")
    # dead-lettering stays allowed
    assert (await bridge.jetstream().publish("deadletter.guarded", b"{}")).stream == "deadletter"
    await bridge.close()
    assert await count(admin_js, "results") == results_before

    errs = []
    col = await as_role(cfg, server, "collector", errs)
    for subject in (
        "$JS.API.STREAM.MSG.GET.results",
        "$JS.API.CONSUMER.CREATE.results",
        "$JS.API.DIRECT.GET.KV_tierflow_webhooks.$KV.tierflow_webhooks.x",
        "$JS.API.STREAM.MSG.GET.KV_tierflow_webhooks",
    ):
        await col.publish(subject, b"{}")
        await refused(col, errs, "publish", subject)
    await col.close()


async def test_wrong_or_missing_nats_credentials_are_refused(
    secured: tuple[Config, NatsServer], admin_js: Any
) -> None:
    cfg, server = secured
    ctx = client_ssl_context(cfg)
    gw = credentials(cfg, "gateway")
    assert gw.user == "tierflow-gateway" and len(gw.password) >= 24
    for user, password in [(gw.user, "wrong"), (None, None), ("tierflow-admin", gw.password)]:
        with pytest.raises(nats.errors.AuthorizationError):
            await connect(server.url, user=user, password=password, tls=ctx, connect_attempts=1)
    # generated passwords live 0600 under the state dir, and only in nats.conf besides
    assert stat.S_IMODE(secrets_path(cfg).stat().st_mode) == 0o600
    assert stat.S_IMODE(server.config_path.stat().st_mode) == 0o600


async def test_analysis_jobs_write_results_as_their_role_over_tls(
    secured: tuple[Config, NatsServer], admin_js: Any
) -> None:
    from jobs.sink import ResultSink

    cfg, server = secured
    target = NatsEndpoint.from_config(cfg, "analysis", url=server.url)
    assert target.user == "tierflow-analysis" and target.password
    assert target.tls_ca == str(cfg.state_path / "certs" / "ca.pem")
    assert target.to_options()["tlsCa"] == target.tls_ca
    sink = ResultSink.for_query(target, "sec_q")
    nc = await sink.connect()
    try:
        report = await sink.apublish_results(nc, [{"key": "k1", "n": 1}], 0)
        assert report.published == 1 and report.kv_puts == 1
        status, connz = server.monitor("connz?auth=true&limit=1024")
        mine = [c for c in connz["connections"] if c.get("name") == "result-sink-sec_q"]
        assert status == 200 and mine[0]["authorized_user"] == "tierflow-analysis"
        assert mine[0]["tls_version"].startswith("1.")
    finally:
        await nc.close()
    # the defaults: shared (empty) credentials, no CA
    plain = NatsEndpoint.from_config(load(environ={}), "analysis", url="nats://127.0.0.1:4222")
    assert (plain.user, plain.password, plain.tls_ca) == (None, None, None)


@pytest.mark.unit
def test_permission_names_match_the_modules_that_use_them() -> None:
    from actors.access import cursors, webhooks
    from actors.collection import buffer
    from runtime.nats import lease
    from runtime.nats import roles as nats_roles

    assert nats_roles.BUFFER_STREAM == buffer.BUFFER_STREAM
    assert nats_roles.LEASE_BUCKET == lease.LEASE_BUCKET
    assert nats_roles.CURSOR_BUCKET == cursors.BUCKET
    assert nats_roles.WEBHOOK_BUCKET == webhooks.BUCKET
    assert nats_roles.WEBHOOK_DEADLETTER == webhooks.DEADLETTER_SUBJECT
    own = {"orders": {"subjects": ["raw.orders"]}}
    perms = role_permissions(load(environ={}, overrides={"streams": own}))
    assert perms["admin"]["publish"]["allow"] == [">"]
    assert "raw.orders" in perms["bridge"]["publish"]["allow"]
    assert "results.>" not in perms["bridge"]["publish"]["allow"]
    for role in ("gateway", "collector", "analysis", "producer"):
        assert "raw.orders" not in perms[role]["publish"]["allow"]
        assert ">" not in perms[role]["publish"]["allow"]


# --------------------------------------------------------------------------- encryption at rest


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def _store_marker(server: NatsServer, **connect_kw: Any) -> None:
    nc = await connect(server.url, **connect_kw)
    js = nc.jetstream()
    await js.add_stream(name="atrest", subjects=["atrest.>"])
    await js.publish("atrest.x", MARKER)
    await nc.close()


async def test_jetstream_encryption_at_rest(
    secured: tuple[Config, NatsServer], admin_js: Any, nats_factory: NatsFactory
) -> None:
    cfg, server = secured
    who = credentials(cfg, "admin")
    kw = {"user": who.user, "password": who.password, "tls": client_ssl_context(cfg)}
    await _store_marker(server, **kw)
    assert _files_containing(server.store_dir, MARKER) == []
    assert _files_containing(cfg.state_path, JS_KEY.encode()) == []  # the key is not on disk
    # and the server reads its own encrypted store back after a restart
    server.restart()
    nc = await connect(server.url, **kw)
    assert (await nc.jetstream().get_msg("atrest", 1)).data == MARKER
    await nc.close()

    with nats_factory() as plain:  # the default: no cipher
        await _store_marker(plain)
        assert _files_containing(plain.store_dir, MARKER) != []


# --------------------------------------------------------------------------- HTTP tiers on Ray


@pytest.fixture(scope="module")
def tier(ray_module: Any, secured: tuple[Config, NatsServer], admin_js: Any) -> Iterator[Any]:
    from cluster.pipeline import start_collection_tier

    cfg, server = secured
    t = start_collection_tier(cfg, nats_url=server.url)
    yield t
    t.stop()


async def test_collector_https_tokens_and_nats_ingest_as_roles(
    secured: tuple[Config, NatsServer], admin_js: Any, tier: Any
) -> None:
    cfg, server = secured
    port = tier.collector_port
    url = f"https://127.0.0.1:{port}/v1/streams/guarded/events?wait=queued"
    ctx = client_ssl_context(cfg)
    before = await count(admin_js, "guarded")
    good = {"Authorization": f"Bearer {PRODUCER_TOKEN}"}
    async with aiohttp.ClientSession() as s:
        for headers, status in [({}, 401), ({"Authorization": "Bearer nope"}, 401)]:
            async with s.post(url, json={"id": "refused"}, headers=headers, ssl=ctx) as r:
                assert r.status == status
        with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port
            async with s.post(url.replace("https", "http"), json={"id": "plain"}, headers=good):
                pass
        async with s.post(url, json={"id": "tls-ok"}, headers=good, ssl=ctx) as r:
            assert r.status == 200, await r.text()
    # pub/sub ingest: a NATS producer's request reaches the collector (its role user)
    errs: list[Exception] = []
    prod = await as_role(cfg, server, "producer", errs)
    reply = await prod.request("ingest.guarded", b'{"id": "nats-ok"}', timeout=30)
    await prod.close()
    assert msgspec.json.decode(reply.data)["ids"] == ["nats-ok"]

    async def stored() -> list[str]:
        msgs = [await admin_js.get_msg("guarded", s) for s in range(before + 1, before + 3)]
        return sorted(m.headers["Nats-Msg-Id"] for m in msgs)

    got = await await_until(stored, timeout=60, what="both accepted events", swallow=True)
    assert got == ["nats-ok", "tls-ok"]
    assert await count(admin_js, "guarded") == before + 2  # refused ones never arrived


async def test_gateway_https_and_tokens_reading_as_its_role(
    secured: tuple[Config, NatsServer], admin_js: Any, ray_module: Any
) -> None:
    import ray

    from actors.access.gateway import Gateway
    from runtime.supervision.ray_actors import supervised_options

    cfg, server = secured
    await admin_js.publish("raw.guarded", b'{"for": "readers"}')
    seq = await count(admin_js, "guarded")

    def start(port: int) -> Any:
        return (
            ray.remote(Gateway)
            .options(**supervised_options("sec-gateway", NS, num_cpus=0))
            .remote(
                str(cfg.state_path),
                name="sec-gateway",
                config=cfg.to_dict(),
                nats_url=server.url,
                port=port,
            )
        )

    loop = asyncio.get_running_loop()
    # a port chosen free, and chosen again if another process takes it first
    handle, port = await loop.run_in_executor(
        None, lambda: start_on_free_port("sec-gateway", NS, start)
    )
    try:
        endpoints = await loop.run_in_executor(
            None, lambda: ray.get(handle.endpoints.remote(), timeout=30)
        )
        assert endpoints["url"] == f"https://{endpoints['host']}:{port}"
        ctx = client_ssl_context(cfg)
        poll = f"https://127.0.0.1:{port}/v1/poll/guarded?after={seq - 1}&timeout=0"
        async with aiohttp.ClientSession() as s:
            async with s.get(poll, ssl=ctx) as r:
                assert r.status == 401
            async with s.get(poll, ssl=ctx, headers={"Authorization": "Bearer x"}) as r:
                assert r.status == 401
            auth = {"Authorization": f"Bearer {CONSUMER_TOKEN}"}
            async with s.get(poll, ssl=ctx, headers=auth) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
            assert [e["data"] for e in body["events"]] == [{"for": "readers"}]
            with pytest.raises(aiohttp.ClientError):
                async with s.get(poll.replace("https", "http"), headers=auth) as r:
                    await r.read()
    finally:
        await loop.run_in_executor(None, lambda: ray.kill(handle, no_restart=True))


async def test_pipeline_publishes_as_bridge_and_ingests_with_credentials(
    secured: tuple[Config, NatsServer], admin_js: Any, tier: Any
) -> None:
    """The stream pattern with role users and TLS: the ingest node reads the source and
    writes the buffer as `ingest`, the collectors read it as `collector`, and the bridge
    publishes to the stream as `bridge`; every event the source sent arrives once."""
    cfg, server = secured
    nc = await connect_nats(cfg, server.url, name="sec-verify", role="admin")
    try:

        async def arrived() -> bool:
            return sum((await stream_ids(nc, "sourced")).values()) >= SOURCED_EVENTS

        await await_until(arrived, 120, 0.2, what="the source's events", swallow=True)
        ids = await stream_ids(nc, "sourced")
    finally:
        await nc.close()
    assert sorted(int(i.rsplit(":", 1)[1]) for i in ids) == list(range(SOURCED_EVENTS))
    assert set(ids.values()) == {1}

    status, connz = server.monitor("connz?auth=true&limit=1024")
    assert status == 200
    conns = connz["connections"]

    def by_prefix(prefix: str) -> list[dict[str, Any]]:
        return [c for c in conns if c.get("name", "").startswith(prefix)]

    bridges, ingest = by_prefix("bridge-"), by_prefix("tierflow-ingest-")
    collectors = by_prefix("collector-")
    assert bridges and ingest and collectors, [c.get("name") for c in conns]
    for role, mine in (("bridge", bridges), ("ingest", ingest), ("collector", collectors)):
        want = credentials(cfg, role).user
        assert want == f"tierflow-{role}"
        assert {c["authorized_user"] for c in mine} == {want}, role
        assert all(c["tls_version"].startswith("1.") for c in mine), role
    # `raw.sourced` only admin and bridge may publish, and the bridge's client sent them
    assert sum(c["in_msgs"] for c in bridges) >= SOURCED_EVENTS


def test_no_secret_in_any_log_of_the_secured_run(
    secured: tuple[Config, NatsServer], tier: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs after the HTTP tests: every log they produced is free of every secret."""
    import ray

    cfg, server = secured
    passwords = json.loads(secrets_path(cfg).read_text()).values()
    needles = [PRODUCER_TOKEN, CONSUMER_TOKEN, JS_KEY, *passwords]
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("tierflow.test").info("config %s", cfg)  # a careless log line
    texts = {"caplog": caplog.text, "nats-server.log": server.log_path.read_text()}
    node = ray._private.worker.global_worker.node
    for path in Path(node.get_logs_dir_path()).rglob("*"):
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            texts[str(path)] = path.read_text(errors="replace")
    assert len(texts) > 3
    leaks = {name: s for name, text in texts.items() for s in needles if s in text}
    assert leaks == {}
    assert os.environ.get("TIERFLOW_JS_KEY") is None  # the key went to the server only
