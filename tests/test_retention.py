"""jobs/retention.py: an archived stream loses only what its archive holds (policy alone, then
against a real nats-server with the stream made the way `tierflow up` makes it)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.api import DiscardPolicy
from nats.js.errors import APIError, NotFoundError

from jobs.retention import HIGH_WATER, LOW_WATER, Usage, enforce, first_since, purge_below, warning
from runtime.config import load
from runtime.engines.services import ensure_streams
from runtime.nats.publisher import api_error_retryable
from runtime.nats.server import NatsServer, connect

pytestmark = pytest.mark.timeout(120)
on_session_loop = pytest.mark.asyncio(loop_scope="session")

# ---- the policy -------------------------------------------------------------------------


@st.composite
def situations(draw: st.DrawFn) -> tuple[Usage, int, int, int]:
    first = draw(st.integers(1, 10_000))
    messages = draw(st.integers(0, 10_000))
    last = first + messages - 1 if messages else first - 1
    size = draw(st.integers(1, 2_000))
    usage = Usage(first, last, messages, messages * size)
    archived_next = draw(st.integers(1, last + 2))
    aged_below = draw(st.integers(first, last + 1))
    max_bytes = draw(st.sampled_from([-1, 0]) | st.integers(1, 20_000_000))
    return usage, archived_next, aged_below, max_bytes


@pytest.mark.unit
@given(situations())
def test_nothing_the_archive_lacks_is_ever_purged(s: tuple[Usage, int, int, int]) -> None:
    usage, archived_next, aged_below, max_bytes = s
    below = purge_below(usage, archived_next, aged_below=aged_below, max_bytes=max_bytes)
    assert usage.first_seq <= below <= usage.last_seq + 1
    assert below <= max(archived_next, usage.first_seq)  # never past the archive
    if archived_next > usage.last_seq and usage.messages:
        assert below >= aged_below  # fully archived: the age limit holds exactly
        if max_bytes > 0 and usage.bytes > HIGH_WATER * max_bytes:
            left = usage.last_seq + 1 - below
            assert left * (usage.bytes / usage.messages) <= LOW_WATER * max_bytes + 1e-6


@pytest.mark.unit
def test_purge_below_examples() -> None:
    u = Usage(first_seq=101, last_seq=200, messages=100, bytes=100_000)  # 1,000 B each
    assert purge_below(u, 201, aged_below=151, max_bytes=-1) == 151  # age only
    assert purge_below(u, 131, aged_below=151, max_bytes=-1) == 131  # the archive lags
    assert purge_below(u, 201, aged_below=101, max_bytes=105_000) == 117  # 95% -> 80%: 16
    assert purge_below(u, 201, aged_below=101, max_bytes=200_000) == 101  # 50%: nothing
    assert purge_below(u, 90, aged_below=151, max_bytes=-1) == 101  # archive behind first
    assert purge_below(Usage(5, 4, 0, 0), 5, aged_below=5, max_bytes=10) == 5


@pytest.mark.unit
def test_the_warning_names_a_full_stream_whose_archive_lags() -> None:
    u = Usage(first_seq=1, last_seq=100, messages=100, bytes=95_000)
    text = warning("clicks", u, archived_next=41, max_bytes=100_000)
    assert text is not None and "'clicks' is 95%" in text and "60 events behind" in text
    assert warning("clicks", u, archived_next=101, max_bytes=100_000) is None  # caught up
    assert warning("clicks", u, archived_next=41, max_bytes=-1) is None  # no byte limit
    assert warning("clicks", Usage(1, 100, 100, 50_000), 41, 100_000) is None  # room left


# ---- against nats-server ----------------------------------------------------------------

STREAM = "kept"
SUBJECT = "raw.kept"


@pytest.fixture(scope="module")
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, name="test-retention")
    yield client
    await client.close()


async def fresh(nc: Client, max_bytes: int = -1) -> None:
    js = nc.jetstream()
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(STREAM)
    cfg = load(
        environ={},
        overrides={
            "streams": {
                STREAM: {
                    "subjects": [SUBJECT],
                    "max_age_s": 60,
                    "max_bytes": max_bytes,
                    "archive": {},
                }
            }
        },
    )
    await ensure_streams(nc, cfg)


async def publish(nc: Client, n: int, size: int = 200) -> list[int]:
    js = nc.jetstream()
    futs = [await js.publish_async(SUBJECT, b"x" * size) for _ in range(n)]
    return [(await f).seq for f in futs]


@on_session_loop
async def test_an_archived_stream_is_made_to_refuse_rather_than_drop(nc: Client) -> None:
    await fresh(nc, max_bytes=20_000)
    info = await nc.jetstream().stream_info(STREAM)
    assert info.config.max_age in (None, 0) and info.config.discard == DiscardPolicy.NEW
    js = nc.jetstream()
    await publish(nc, 60)  # ~15 KB
    with pytest.raises(APIError) as refused:
        for _ in range(100):  # bounded: max_bytes is reached within ~25 more
            await js.publish(SUBJECT, b"x" * 200)
    assert api_error_retryable(refused.value.code or 0), refused.value  # the bridge retries
    full = (await js.stream_info(STREAM)).state
    assert full.first_seq == 1, "nothing old was dropped to make room"
    assert full.bytes > HIGH_WATER * 20_000
    # the archive has the first 10: only those may go, and the stream says it is stuck
    done = await enforce(js, STREAM, 11, max_age_s=0, max_bytes=20_000)
    assert (done.below, done.purged) == (11, 10)
    assert done.warning is not None and f"{full.last_seq - 10} events behind" in done.warning
    # under HIGH_WATER again: nothing more goes, archived or not
    done = await enforce(js, STREAM, full.last_seq + 1, max_age_s=0, max_bytes=20_000)
    assert (done.below, done.purged) == (11, 0)
    # full again, now fully archived: purged down to LOW_WATER, oldest first
    with pytest.raises(APIError):
        for _ in range(100):
            await js.publish(SUBJECT, b"x" * 200)
    full = (await js.stream_info(STREAM)).state
    done = await enforce(js, STREAM, full.last_seq + 1, max_age_s=0, max_bytes=20_000)
    state = (await js.stream_info(STREAM)).state
    assert state.first_seq == done.below > 11 and state.last_seq == full.last_seq
    assert state.bytes <= LOW_WATER * 20_000 + full.bytes / full.messages
    assert done.warning is None  # the archive had everything: nothing was stuck
    assert await publish(nc, 5)  # room again


@on_session_loop
async def test_the_age_limit_purges_archived_events_only(nc: Client) -> None:
    await fresh(nc)
    await publish(nc, 50)
    await asyncio.sleep(0.05)  # two stored-time generations, apart by more than clock jitter
    cutoff = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.05)
    young = await publish(nc, 50)
    js = nc.jetstream()
    # a gap: the first young event deleted; the search still finds the boundary
    await js.delete_msg(STREAM, young[0])
    state = (await js.stream_info(STREAM)).state
    usage = Usage(state.first_seq, state.last_seq, state.messages, state.bytes)
    assert young[0] <= await first_since(js, STREAM, cutoff, usage) <= young[1]
    assert await first_since(js, STREAM, cutoff - dt.timedelta(hours=1), usage) == 1
    assert await first_since(js, STREAM, dt.datetime.now(dt.UTC), usage) == young[-1] + 1
    now = cutoff + dt.timedelta(seconds=60)  # as if 60 s later: the first 50 are too old
    done = await enforce(js, STREAM, 21, max_age_s=60, max_bytes=-1, now=now)
    assert (done.below, done.purged) == (21, 20)  # only what the archive holds
    done = await enforce(js, STREAM, 1_000, max_age_s=60, max_bytes=-1, now=now)
    assert done.purged == 30 and young[0] <= done.below <= young[1]  # the age limit applies
    assert (await js.stream_info(STREAM)).state.first_seq == young[1]
    done = await enforce(js, STREAM, 1_000, max_age_s=60, max_bytes=-1, now=now)
    assert done.purged == 0  # idempotent
