"""Retention never purges what a replicating copy on another site has not sourced
(jobs/retention.py, jobs/retention_holds.py, runtime/geo/replication.py `sourced_next`).

The policy alone first; then two real sites (one nats-server each, joined by a leaf link),
an archived and replicated stream whose archive is taken as caught up (the archive's
position is one hold among others; here the others are what is tested), site B's servers
killed for longer than the stream's `max_age_s` while A takes events and retention passes
run, then B back: every event on B exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.chaos.site_loss import read_copy
from jobs.copies import CopyId, acurrent_copy
from jobs.retention import (
    HIGH_WATER,
    Hold,
    Purge,
    Usage,
    floor_of,
    purge_below,
    warning,
)
from jobs.retention_holds import SiteFloors, confirm, reader_holds, trim
from runtime.config import validate
from runtime.engines.services import ensure_streams
from runtime.geo.replication import link_deny, source_header_seq, sourced_next
from runtime.geo.sites import NatsSites
from runtime.nats.publisher import api_error_retryable
from runtime.nats.server import connect
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(300)

AGED, FULL = "aged", "full"
MAX_AGE_S = 2.0
MAX_BYTES = 40_000

# ---- the policy -------------------------------------------------------------------------


@st.composite
def situations(draw: st.DrawFn) -> tuple[Usage, int, list[Hold], int, int]:
    first = draw(st.integers(1, 10_000))
    messages = draw(st.integers(0, 10_000))
    last = first + messages - 1 if messages else first - 1
    usage = Usage(first, last, messages, messages * draw(st.integers(1, 2_000)))
    archived_next = draw(st.integers(1, last + 2))
    sites = draw(st.lists(st.integers(0, last + 2), max_size=3))
    readers = draw(st.lists(st.integers(0, last + 2), max_size=2))
    holds = [Hold(n, site=f"site-{i}") for i, n in enumerate(sites)]
    holds += [Hold(n, reader=f"r{i}") for i, n in enumerate(readers)]
    aged_below = draw(st.integers(first, last + 1))
    max_bytes = draw(st.sampled_from([-1, 0]) | st.integers(1, 20_000_000))
    return usage, archived_next, holds, aged_below, max_bytes


@pytest.mark.unit
@given(situations())
def test_nothing_any_holder_still_needs_is_purged(
    s: tuple[Usage, int, list[Hold], int, int],
) -> None:
    usage, archived_next, holds, aged_below, max_bytes = s
    floor, at = floor_of(archived_next, holds)
    assert floor == min([archived_next, *(h.next_seq for h in holds)])
    assert at and all(h.next_seq == floor for h in at)
    below = purge_below(usage, floor, aged_below=aged_below, max_bytes=max_bytes)
    assert usage.first_seq <= below <= usage.last_seq + 1
    for need in [archived_next, *(h.next_seq for h in holds)]:
        assert below <= max(need, usage.first_seq)  # never past anyone's next sequence


@pytest.mark.unit
def test_the_floor_is_the_lowest_of_archive_sites_and_readers() -> None:
    b, r = Hold(40, site="site-b"), Hold(70, reader="sql")
    assert floor_of(100, [b, r]) == (40, (b,))
    assert floor_of(30, [b, r]) == (30, (Hold(30),))
    assert floor_of(40, [b]) == (40, (Hold(40), b))
    u = Usage(first_seq=1, last_seq=200, messages=200, bytes=200_000)
    assert purge_below(u, floor_of(201, [b])[0], aged_below=150, max_bytes=-1) == 40


@pytest.mark.unit
def test_the_warning_names_the_site_that_keeps_a_full_stream_full() -> None:
    u = Usage(first_seq=1, last_seq=100, messages=100, bytes=95_000)
    text = warning("clicks", u, 101, 100_000, [Hold(31, site="site-b")])
    assert text is not None and "'clicks' is 95%" in text and "site 'site-b'" in text
    assert "70 events" in text and "sequence 31" in text
    text = warning("clicks", u, 101, 100_000, [Hold(90, reader="history read, pid 7")])
    assert text is not None and "reader 'history read, pid 7'" in text
    # the archive lags most: the archive's own line, as without sites
    text = warning("clicks", u, 21, 100_000, [Hold(31, site="site-b")])
    assert text is not None and "archive is 80 events behind" in text and "site-b" not in text
    assert warning("clicks", u, 101, 100_000, [Hold(101, site="site-b")]) is None  # caught up
    assert warning("clicks", Usage(1, 100, 100, 50_000), 101, 100_000, [Hold(1, site="b")]) is None


@pytest.mark.unit
def test_a_site_floor_moves_only_when_the_site_confirms() -> None:
    assert confirm({}, "site-b", 12) == {"site-b": 12}
    assert confirm({"site-b": 12}, "site-b", None) == {"site-b": 12}  # unreachable: holds
    assert confirm({"site-b": 12}, "site-b", 9) == {"site-b": 12}  # never back
    assert confirm({"site-b": 12}, "site-c", None) == {"site-b": 12}  # never heard: no entry


@pytest.mark.unit
def test_site_floors_are_kept_per_copy(tmp_path: Path) -> None:
    here = CopyId(domain="site-a", stream="s", created="1")
    SiteFloors(copy=here, sites={"site-b": 5}).save(tmp_path, "s")
    assert SiteFloors.load(tmp_path, "s", here).sites == {"site-b": 5}
    again = CopyId(domain="site-a", stream="s", created="2")  # the stream made again
    assert SiteFloors.load(tmp_path, "s", again).sites == {}
    assert reader_holds(tmp_path, "s") == []


@pytest.mark.unit
def test_the_origin_sequence_is_read_from_the_source_header() -> None:
    raw = (
        b"NATS/1.0\r\nNats-Msg-Id: a4\r\nNats-Stream-Source: orders:x1TzAtgz 5 raw.orders "
        b"geo.site-a.raw.orders raw.orders 1kXo5QmP\r\n\r\n"
    )
    assert source_header_seq(raw) == 5
    assert source_header_seq(b"NATS/1.0\r\nNats-Msg-Id: a4\r\n\r\n") is None


# ---- two real sites ---------------------------------------------------------------------


def _cfg(tmp: Path) -> Any:
    rep = {"to": ["site-b"]}
    return validate(
        {
            "state_dir": str(tmp),
            "streams": {
                AGED: {
                    "subjects": [f"raw.{AGED}"],
                    "max_age_s": MAX_AGE_S,
                    "archive": {},
                    "replicate": rep,
                },
                FULL: {
                    "subjects": [f"raw.{FULL}"],
                    "max_bytes": MAX_BYTES,
                    "archive": {},
                    "replicate": rep,
                },
            },
        }
    )


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsSites]:
    cfg = _cfg(tmp_path_factory.mktemp("floor-cfg"))
    base = tmp_path_factory.mktemp("floor-sites")
    with NatsSites(base, sites=2, nodes=1, deny=link_deny(cfg)) as s:
        yield s


async def _pass(nc: Any, cfg: Any, stream: str, root: Path) -> Purge:
    """One retention pass as the analysis driver runs it, with the archive caught up (its
    position past the stream's last sequence): only the other holds keep anything."""
    here: CopyId = await acurrent_copy(nc, stream)
    last = (await nc.jetstream().stream_info(stream)).state.last_seq
    return await trim(nc, stream, cfg.streams[stream], root, here, lambda: last + 1)


async def _ids_on(url: str, stream: str) -> Counter[str]:
    return Counter(i for i, _ in await read_copy(url, stream))


async def _publish(js: Any, stream: str, ids: list[str]) -> list[int]:
    futs = [
        await js.publish_async(f"raw.{stream}", i.encode(), headers={"Nats-Msg-Id": i}) for i in ids
    ]
    return [(await f).seq for f in futs]


async def _b_back(sites: NatsSites) -> None:
    if not sites.site("site-b").running:
        await asyncio.to_thread(sites.start_site, "site-b")


async def _caught_up(nc: Any, stream: str) -> None:
    """Wait until B's copy has sourced every event A's copy still holds (whatever that
    is: a copy that lost events to a purge catches up to nothing)."""

    async def done() -> bool:
        last = (await nc.jetstream().stream_info(stream)).state.last_seq
        return await sourced_next(nc, stream, "site-a", "site-b") == last + 1

    # a source whose origin was lost retries with a growing backoff (docs/geo.md)
    await await_until(done, 180, 0.5, f"B caught up on {stream}", swallow=True)


async def test_a_site_cut_off_longer_than_max_age_gets_every_event_once(
    sites: NatsSites, tmp_path: Path
) -> None:
    a, b = sites.site("site-a"), sites.site("site-b")
    await _b_back(sites)
    cfg = _cfg(tmp_path)
    root = tmp_path / "checkpoints"
    nca = await connect(a.url)
    try:
        await ensure_streams(nca, cfg)
        js = nca.jetstream()
        warm = [f"warm-{i}" for i in range(10)]
        await _publish(js, AGED, warm)
        await _caught_up(nca, AGED)
        await _pass(nca, cfg, AGED, root)  # B confirms its position
        assert await asyncio.to_thread(sites.kill_site, "site-b")

        ids = [f"cut-{i}" for i in range(1000)]
        first_cut = (await _publish(js, AGED, ids))[0]
        published = time.monotonic()

        # the link stays down for longer than max_age_s, retention passes running meanwhile
        await await_until(
            lambda: time.monotonic() - published > 2 * MAX_AGE_S, 30, 0.1, "past max_age_s"
        )
        passes = [await _pass(nca, cfg, AGED, root) for _ in range(3)]
        kept = (await js.stream_info(AGED)).state

        await _b_back(sites)
        await _caught_up(nca, AGED)
        got = await _ids_on(b.url, AGED)
        every = [*warm, *ids]
        missing = [i for i in every if not got[i]]
        assert not missing, f"B never got {len(missing)} events A acknowledged: {missing[:3]}"
        assert [got[i] for i in every] == [1] * len(every) and set(got.values()) == {1}
        # ...because A held them while B was away, and said who held them
        assert kept.first_seq <= first_cut and kept.messages >= 1000
        assert all([h.site for h in done.held_by] == ["site-b"] for done in passes), passes

        # B has confirmed: the same pass now purges what the age limit lets go
        done = await _pass(nca, cfg, AGED, root)
        assert done.purged >= 1000 and not done.held_by, done
    finally:
        await nca.close()
        await _b_back(sites)


async def test_a_full_stream_held_by_a_site_refuses_new_events_and_names_the_site(
    sites: NatsSites, tmp_path: Path
) -> None:
    a, b = sites.site("site-a"), sites.site("site-b")
    await _b_back(sites)
    cfg = _cfg(tmp_path)
    root = tmp_path / "checkpoints"
    nca = await connect(a.url)
    try:
        await ensure_streams(nca, cfg)
        js = nca.jetstream()
        # B's copy stores each of A's events under a longer subject, with a source header:
        # room for all of them (its own retention would make it over several passes)
        jsb = nca.jetstream(domain="site-b")
        b_copy = (await jsb.stream_info(FULL)).config
        b_copy.max_bytes = 10 * MAX_BYTES
        await jsb.update_stream(b_copy)
        done = await _pass(nca, cfg, FULL, root)  # B answers: it has sourced nothing yet
        assert done.purged == 0
        assert await asyncio.to_thread(sites.kill_site, "site-b")

        acked: list[str] = []
        with pytest.raises(nats.js.errors.APIError) as refused:
            for i in range(1000):  # bounded: max_bytes is reached within ~200
                await js.publish(f"raw.{FULL}", b"x" * 200, headers={"Nats-Msg-Id": f"f-{i}"})
                acked.append(f"f-{i}")
        assert api_error_retryable(refused.value.code or 0), refused.value  # the bridge retries
        full = (await js.stream_info(FULL)).state
        assert full.bytes > HIGH_WATER * MAX_BYTES

        done = await _pass(nca, cfg, FULL, root)
        assert done.purged == 0, "purged what site-b had not sourced"
        assert done.warning is not None and "site 'site-b'" in done.warning, done.warning
        with pytest.raises(nats.js.errors.APIError):  # still full: refused, to wait upstream
            await js.publish(f"raw.{FULL}", b"x" * 200, headers={"Nats-Msg-Id": "f-late"})

        await _b_back(sites)
        await _caught_up(nca, FULL)
        got = await _ids_on(b.url, FULL)
        assert [got[i] for i in acked] == [1] * len(acked)
        done = await _pass(nca, cfg, FULL, root)
        assert done.purged > 0 and done.warning is None, done
        await js.publish(f"raw.{FULL}", b"x" * 200, headers={"Nats-Msg-Id": "f-late"})
    finally:
        await nca.close()
        await _b_back(sites)
