"""The leaf links between sites: authenticated (a user and password made per
`NatsSites`, kept 0600 with the sites' state) and, with `[tls]` on, TLS with the runtime's
CA both ways. Clients of each site keep the single server's users (role users here).

Real nats-servers: two sites of one node each, TLS and role users on; rogue servers that
dial a site's leaf port with wrong, missing or plain-text credentials.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from runtime.certs import make_dev_certs
from runtime.config import validate
from runtime.engines.services import ensure_streams
from runtime.geo.sites import LEAF_AUTH_FILE, LeafAuth, NatsSites, leaf_block, read_leaf_auth
from runtime.nats.server import NatsEndpoint, NatsServer, connect
from runtime.tls import tls_files
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(90)

STREAM, SUBJECT = "orders", "raw.orders"


def _cfg(state: Path) -> Any:
    return validate(
        {
            "state_dir": str(state),
            "tls": {"enabled": True},
            "nats": {"role_users": True},
            "streams": {STREAM: {"subjects": [SUBJECT], "replicate": {"to": ["site-b"]}}},
        }
    )


@pytest.mark.unit
def test_leaf_block_requires_the_credentials_and_tls_it_presents(tmp_path: Path) -> None:
    make_dev_certs(tmp_path / "certs")
    files = tls_files(_cfg(tmp_path))
    assert files is not None
    auth = LeafAuth(password="pw-1")
    hub = "\n".join(leaf_block("127.0.0.1:7422", [], auth=auth, tls=files))
    assert 'user: "tierflow-leaf"' in hub and 'password: "pw-1"' in hub
    # no client pair in [tls]: the listener verifies no certificate, the dialler presents none
    assert "verify: true" not in hub and "remotes" not in hub
    leaf = "\n".join(leaf_block("127.0.0.1:7423", ["127.0.0.1:7422"], ["raw.x"], auth, files))
    assert '"nats-leaf://tierflow-leaf:pw-1@127.0.0.1:7422"' in leaf
    assert leaf.count("ca_file") == 2  # the listener's block and the remote's
    assert "pw-1" not in repr(auth) and LeafAuth().password != LeafAuth().password
    with pytest.raises(ValueError):
        LeafAuth(password="a@b")
    open_hub = "\n".join(leaf_block("127.0.0.1:7422", []))  # the old, open shape
    assert "authorization" not in open_hub and "tls" not in open_hub


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsSites, Any]]:
    state = tmp_path_factory.mktemp("geo-links-state")
    make_dev_certs(state / "certs")
    cfg = _cfg(state)
    with NatsSites.from_config(cfg, state / "sites", sites=2, nodes=1) as s:
        yield s, cfg


async def _messages(cfg: Any, url: str) -> dict[str, int]:
    nc = await NatsEndpoint.from_config(cfg, "gateway", url=url).connect()
    try:
        info = await nc.jetstream().stream_info(STREAM, subjects_filter=">")
        return dict(info.state.subjects or {})
    finally:
        await nc.close()


async def test_authenticated_tls_links_replicate_both_ways(
    secured: tuple[NatsSites, Any],
) -> None:
    sites, cfg = secured
    a, b = sites.site("site-a"), sites.site("site-b")
    assert sites.tls is not None and sites.tls.client_cert is not None  # mutual TLS
    _, varz = a.servers[0].monitor("varz")
    assert varz["leaf"]["tls_required"] and varz["leaf"]["tls_verify"]
    _, leafz = b.servers[0].monitor("leafz")
    assert leafz["leafnodes"] == 1

    # clients of each site: role users over TLS, as with one server
    admin = await NatsEndpoint.from_config(cfg, "admin", url=a.url).connect()
    bridge_a = await NatsEndpoint.from_config(cfg, "bridge", url=a.url).connect()
    bridge_b = await NatsEndpoint.from_config(cfg, "bridge", url=b.url).connect()
    try:
        await ensure_streams(admin, cfg)  # B's copy made through the TLS link
        for i in range(5):
            await bridge_a.jetstream().publish(SUBJECT, b"A", headers={"Nats-Msg-Id": f"a{i}"})
            await bridge_b.jetstream().publish(SUBJECT, b"B", headers={"Nats-Msg-Id": f"b{i}"})

        async def converged() -> bool:
            return await _messages(cfg, a.url) == {
                SUBJECT: 5,
                "geo.site-b.raw.orders": 5,
            } and await _messages(cfg, b.url) == {SUBJECT: 5, "geo.site-a.raw.orders": 5}

        await await_until(converged, 20, 0.1, "both copies hold both sites' 5 events")
    finally:
        for nc in (admin, bridge_a, bridge_b):
            await nc.close()
    with pytest.raises(nats.errors.AuthorizationError):  # no credentials: refused by B
        await connect(b.url, tls=NatsEndpoint(url=b.url, tls_ca=str(sites.tls.ca)).ssl_context())

    state = sites.write_state()
    secret_file = state.parent / LEAF_AUTH_FILE
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert read_leaf_auth(state.parent) == sites.auth and sites.auth is not None
    assert json.loads(state.read_text())["leaf_auth"] == LEAF_AUTH_FILE
    assert sites.auth.password not in state.read_text()
    for s in a.servers + b.servers:  # nor in the servers' logs (URLs are redacted)
        assert sites.auth.password not in s.log_path.read_text()


def _rogue(tmp: Path, name: str, hub_leaf: int, auth: LeafAuth | None, tls: Any) -> NatsServer:
    """A server of its own JetStream domain dialling the hub's leaf port with these
    credentials: were its link up, A would reach its JetStream as `$JS.<name>.API`."""
    return NatsServer(
        store_dir=tmp / name,
        server_name=name,
        js_domain=name,
        # its own leaf port is never dialled: -1 lets the server take any at bind time, so
        # no other process can take it between a choice and the bind
        extra_conf=leaf_block("127.0.0.1:-1", [f"127.0.0.1:{hub_leaf}"], (), auth, tls),
    )


async def test_a_leaf_with_wrong_or_no_credentials_is_refused(
    secured: tuple[NatsSites, Any], tmp_path: Path
) -> None:
    sites, cfg = secured
    hub = sites.site("site-a").servers[0]
    assert sites.auth is not None and sites.tls is not None
    no_client_pair = tls_files(cfg)  # the CA, but no client certificate to present
    rogues = {
        "rogue-wrong": _rogue(tmp_path, "rogue-wrong", sites.members[0].leaf_ports[0],
                              LeafAuth(password="not-the-password"), sites.tls),
        "rogue-none": _rogue(tmp_path, "rogue-none", sites.members[0].leaf_ports[0],
                             None, sites.tls),
        "rogue-plain": _rogue(tmp_path, "rogue-plain", sites.members[0].leaf_ports[0],
                              sites.auth, None),
        "rogue-nocert": _rogue(tmp_path, "rogue-nocert", sites.members[0].leaf_ports[0],
                               sites.auth, no_client_pair),
    }  # fmt: skip
    admin = await NatsEndpoint.from_config(cfg, "admin", url=hub.url).connect()
    try:
        for r in rogues.values():
            r.start()
        log = ""

        def each_refused_twice() -> bool:  # a rogue dials again every second
            nonlocal log
            log = hub.log_tail(1 << 30)
            return (
                log.count('authentication error - User "tierflow-leaf"') >= 2  # wrong password
                and log.count("Authentication Failure") >= 4  # ... and no credentials
                and log.count("tls: bad certificate") >= 2  # plain: does not trust the CA
                and log.count("client didn't provide a certificate") >= 2  # no client pair
            )

        await await_until(each_refused_twice, 20, 0.1, "the hub refused every rogue twice")
        assert (await admin.request("$JS.site-b.API.INFO", b"", timeout=2)).data  # B's is
        for name, r in rogues.items():
            _, leafz = r.monitor("leafz")
            assert leafz["leafnodes"] == 0, (name, r.log_tail(2000))
            with pytest.raises(nats.errors.NoRespondersError):  # its JetStream is not reachable
                await admin.request(f"$JS.{name}.API.INFO", b"", timeout=2)
        _, leafz = hub.monitor("leafz")
        assert leafz["leafnodes"] == 1, log  # site B's only
    finally:
        await admin.close()
        for r in rogues.values():
            r.stop()


def test_real_host_site_configs_are_valid_and_authenticate_their_links(tmp_path: Path) -> None:
    """cluster/nats-site-{a,b}.conf, rendered as their comments say (envsubst), pass
    `nats-server -t` and carry the leaf authorization, TLS and credentials."""
    import re
    import subprocess

    from runtime.nats.server import nats_server_binary

    certs = make_dev_certs(tmp_path / "certs")
    env = {
        "NATS_SERVER_NAME": "n1", "NATS_HOST": "127.0.0.1", "NATS_CLIENT_PORT": "4222",
        "NATS_MONITOR_PORT": "8222", "NATS_CLUSTER_PORT": "6222", "NATS_LEAF_PORT": "7422",
        "NATS_STORE_DIR": str(tmp_path / "store"), "NATS_LEAF_USER": "tierflow-leaf",
        "NATS_LEAF_PASSWORD": "placeholder-secret", "NATS_TLS_CERT": str(certs.cert),
        "NATS_TLS_KEY": str(certs.key), "NATS_TLS_CA": str(certs.ca),
        "NATS_TLS_CLIENT_CERT": str(certs.client_cert),
        "NATS_TLS_CLIENT_KEY": str(certs.client_key),
        **{f"NATS_ROUTE_{i}": f"10.0.0.{i}:6222" for i in (1, 2, 3)},
        **{f"NATS_HUB_{i}": f"10.1.0.{i}:7422" for i in (1, 2, 3)},
    }  # fmt: skip
    root = Path(__file__).resolve().parents[1]
    for name in ("nats-site-a.conf", "nats-site-b.conf"):
        text = re.sub(r"\$\{(\w+)\}", lambda m: env[m[1]], (root / "cluster" / name).read_text())
        assert "authorization {" in text and "verify: true" in text
        path = tmp_path / name
        path.write_text(text)
        check = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0, check.stdout + check.stderr
    assert "nats-leaf://tierflow-leaf:placeholder-secret@10.1.0.1:7422" in text
