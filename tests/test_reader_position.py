"""delivery_position: the stream sequence and pending count of a JetStream delivery, read
from its reply subject, agree with nats-py's `Msg.metadata` on every shape it parses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg

from actors.access.reader import delivery_position

pytestmark = pytest.mark.unit

numbers = st.integers(min_value=0, max_value=2**63 - 1)
names = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)


def metadata(reply: str) -> tuple[int, int]:
    meta = Msg(None, subject="s", reply=reply, data=b"").metadata  # type: ignore[arg-type]
    return meta.sequence.stream, meta.num_pending


@given(names, names, numbers, numbers, numbers, numbers, numbers)
def test_v1_reply_agrees_with_nats_py(
    stream: str, consumer: str, delivered: int, sseq: int, cseq: int, ts: int, pending: int
) -> None:
    reply = f"$JS.ACK.{stream}.{consumer}.{delivered}.{sseq}.{cseq}.{ts}.{pending}"
    assert delivery_position(reply) == metadata(reply) == (sseq, pending)


@given(names, names, names, numbers, numbers, numbers, numbers, numbers, st.booleans())
def test_v2_reply_agrees_with_nats_py(
    domain: str,
    stream: str,
    consumer: str,
    delivered: int,
    sseq: int,
    cseq: int,
    ts: int,
    pending: int,
    token: bool,
) -> None:
    reply = f"$JS.ACK.{domain}.ACCHASH.{stream}.{consumer}.{delivered}.{sseq}.{cseq}.{ts}.{pending}"
    reply += ".rnd" if token else ""
    assert delivery_position(reply) == metadata(reply) == (sseq, pending)


@pytest.mark.parametrize(
    "reply",
    [
        None,
        "",
        "_INBOX.abc.1",
        "$JS.ACK.s.c.1.2",
        "$JS.API.s.c.1.2.3.4.5",
        "$JS.ACK.a.b.c.d.e.f.g.h.i.j",
    ],
)
def test_other_replies_are_not_read(reply: str | None) -> None:
    assert delivery_position(reply) is None
