"""Event envelope: batch round trip and time-ordered ids."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.data.events import (
    Event,
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    new_event_id,
)

pytestmark = pytest.mark.unit

events = st.builds(
    Event,
    id=st.text(min_size=1, max_size=40),
    stream=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    subject=st.from_regex(r"raw\.[a-z]{1,8}", fullmatch=True),
    data=st.binary(max_size=200),
    received_ms=st.integers(min_value=0, max_value=2**53),
    processed=st.booleans(),
    token=st.text(max_size=20),
)


@given(st.lists(events, max_size=30))
def test_batch_round_trip(batch: list[Event]) -> None:
    assert decode_batch(encode_batch(batch)) == batch
    for e in batch:
        assert decode_event(encode_event(e)) == e


def test_ids_are_unique_time_ordered_uuid7() -> None:
    ids = [new_event_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)  # many share a millisecond: the counter keeps order
    parsed = uuid.UUID(ids[0])
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
