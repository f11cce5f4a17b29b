"""Compacted streams replicated between sites: a site's `latest?key=`
and `/keys` see the keys written on every site, not only its own.

Two real sites (one nats-server each, joined by authenticated leaf links); the gateway's
read functions (actors/access/compacted.py) called directly on each site's copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import make_mocked_request

from actors.access.compacted import (
    CompactedRoutes,
    key_counts,
    latest_message,
    list_filters,
    read_subjects,
)
from actors.access.protocol import StreamRef
from runtime.config import validate
from runtime.data.compaction import key_token
from runtime.engines.services import ensure_streams
from runtime.geo.replication import link_deny, origin_transform
from runtime.geo.sites import NatsSites
from runtime.nats.server import connect
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(90)

STREAM, SUBJECT = "planes", "air.planes"


def _cfg(tmp: Path) -> Any:
    body = {"subjects": [SUBJECT], "compact": {"key": "tail"}, "replicate": {"to": ["site-b"]}}
    return validate({"state_dir": str(tmp), "streams": {STREAM: body}})


@pytest.mark.unit
def test_copies_of_a_compacted_stream_transform_its_key_wildcard(tmp_path: Path) -> None:
    """nats-server refuses a bare `*` in a source's transform destination; the key token of
    a compacted stream's subjects is one."""
    assert origin_transform("site-a", "air.planes.*") == "geo.site-a.air.planes.{{wildcard(1)}}"
    assert origin_transform("site-a", "a.*.b.*") == "geo.site-a.a.{{wildcard(1)}}.b.{{wildcard(2)}}"
    assert origin_transform("site-b", "raw.x.>") == "geo.site-b.raw.x.>"
    # the links deny the subjects the stream captures (with the key), not only the configured
    assert {SUBJECT, f"{SUBJECT}.*"} <= set(link_deny(_cfg(tmp_path)))
    sc = _cfg(tmp_path).streams[STREAM]
    assert read_subjects(sc, "N1") == ["air.planes.N1", "geo.*.air.planes.N1"]
    assert list_filters(sc) == ["air.planes.*", "geo.*.air.planes.*"]


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsSites]:
    cfg = _cfg(tmp_path_factory.mktemp("geo-compaction-cfg"))
    base = tmp_path_factory.mktemp("geo-compaction-sites")
    with NatsSites(base, sites=2, nodes=1, deny=link_deny(cfg)) as s:
        yield s


class _Plane:
    """The few parts of a gateway's DataPlane the compacted routes use, on a real
    connection to one site (every token accepted: the auth rules are tested elsewhere)."""

    def __init__(self, nc: Any, cfg: Any) -> None:
        self.nc, self.js, self.cfg = nc, nc.jetstream(), cfg
        self.counters: Counter[str] = Counter()
        self.access = SimpleNamespace(authenticate=lambda token: None)

    async def stream(self, name: str, token: str | None) -> tuple[StreamRef, None]:
        return StreamRef(public=name, js=name, kv=False), None

    def count(self, p: object) -> None:
        self.counters["refused"] += 1


async def _route(routes: CompactedRoutes, path: str) -> tuple[int, Any]:
    """GET `path` (…/latest?key= or …/keys) through the gateway's handlers."""
    req = make_mocked_request("GET", path, match_info={"stream": STREAM})
    handler = routes.keys if "/keys" in path else routes.latest
    resp = await handler(req)
    return resp.status, msgspec.json.decode(resp.body)


async def _subjects(url: str) -> dict[str, int]:
    nc = await connect(url)
    try:
        info = await nc.jetstream().stream_info(STREAM, subjects_filter=">")
        return dict(info.state.subjects or {})
    finally:
        await nc.close()


async def test_every_site_answers_the_newest_value_of_every_key_from_every_origin(
    sites: NatsSites, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path)
    sc = cfg.streams[STREAM]
    a, b = sites.site("site-a"), sites.site("site-b")
    nca, ncb = await connect(a.url), await connect(b.url)
    try:
        await ensure_streams(nca, cfg)  # both copies, sourcing each other's keys

        async def put(nc: Any, key: object, v: str) -> None:
            body = msgspec.json.encode({"tail": key, "v": v})
            subject = f"{SUBJECT}.{key_token(key)}"  # what the stream logic derives
            await nc.jetstream().publish(subject, body, headers={"Nats-Msg-Id": v})

        await put(nca, "N1", "a1")  # N1 on A, then on B
        await put(nca, 42, "a-only")  # =42 only on A
        a_keys = {"geo.site-a.air.planes.N1": 1, "geo.site-a.air.planes.=42": 1}

        async def b_has_a() -> bool:
            return await _subjects(b.url) == a_keys

        # B holds A's keys only as sourced: the links deny the keyed subjects
        await await_until(b_has_a, 20, 0.1, "B sourced A's two keys (and nothing else)")
        await put(ncb, "N1", "b2")

        async def a_has_b() -> bool:
            return (await _subjects(a.url)).get("geo.site-b.air.planes.N1") == 1

        await await_until(a_has_b, 20, 0.1, "A sourced B's N1")
        # one latest per origin in each copy (max_msgs_per_subject is per subject)
        assert await _subjects(a.url) == {"air.planes.N1": 1, "air.planes.=42": 1,
                                          "geo.site-b.air.planes.N1": 1}  # fmt: skip
        for nc in (nca, ncb):
            js = nc.jetstream()
            n1 = await latest_message(js, STREAM, read_subjects(sc, "N1"))
            assert n1 is not None and msgspec.json.decode(n1.data)["v"] == "b2"
            only_a = await latest_message(js, STREAM, read_subjects(sc, key_token(42)))
            assert only_a is not None and msgspec.json.decode(only_a.data)["v"] == "a-only"
            assert await latest_message(js, STREAM, read_subjects(sc, "nope")) is None
            # each key once, its count over the origins
            counts = await key_counts(nc, "$JS.API", STREAM, list_filters(sc))
            assert counts == {"N1": 2, "=42": 1}
            # the same through the gateway's routes on this site
            routes = CompactedRoutes(_Plane(nc, cfg), plain_latest=None)  # type: ignore[arg-type]
            status, body = await _route(routes, f"/v1/streams/{STREAM}/latest?key=N1")
            assert status == 200 and body["data"]["v"] == "b2" and body["key"] == "N1"
            status, body = await _route(routes, f"/v1/streams/{STREAM}/latest?key_json=42")
            assert status == 200 and body["data"]["v"] == "a-only"
            status, body = await _route(routes, f"/v1/streams/{STREAM}/keys")
            assert status == 200 and body["next"] is None
            assert body["keys"] == [{"key": 42, "token": "=42", "count": 1},
                                    {"key": "N1", "token": "N1", "count": 2}]  # fmt: skip
    finally:
        await nca.close()
        await ncb.close()
