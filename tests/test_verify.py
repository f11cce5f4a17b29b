"""The zero-loss verifier must see real losses and duplicates, not just pass."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from cluster.verify import StreamTally, judge, stream_ids
from runtime.nats.server import connect
from runtime.waiting import await_until
from tests.support import NatsFactory


@pytest.mark.unit
def test_judge_pure() -> None:
    stored = Counter({"a": 1, "b": 2, "x": 1})
    v = judge(["a", "b", "c"], stored)
    assert not v.ok
    assert v.lost == ["c"] and v.duplicated == {"b": 2} and v.unexpected == 1
    assert judge(["a"], Counter({"a": 1})).ok


async def test_reads_every_id_and_sees_a_deleted_message(nats_factory: NatsFactory) -> None:
    with nats_factory() as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="v", subjects=["v.>"])
        ids = [f"e{i}" for i in range(5000)]
        for i, eid in enumerate(ids):
            await js.publish(f"v.{i % 3}", b"x", headers={"Nats-Msg-Id": eid})
        # a second copy of one event under the same id is deduped by JetStream...
        await js.publish("v.0", b"x", headers={"Nats-Msg-Id": "e7"})
        stored = await stream_ids(nc, "v")
        assert judge(ids, stored).ok and sum(stored.values()) == 5000
        assert sum((await stream_ids(nc, "v", "v.1")).values()) == 1667
        # ...so inject the faults the verifier must catch: a loss and a duplicate.
        await js.delete_msg("v", 100)  # e99
        dup = Counter(stored)
        dup["e5"] += 1
        verdict = judge(ids, await stream_ids(nc, "v"))
        assert verdict.lost == ["e99"]
        assert not judge(ids, dup).ok and judge(ids, dup).duplicated == {"e5": 2}
        await nc.close()


@pytest.mark.parametrize("n", [0, 1])
async def test_small_streams(nats_factory: NatsFactory, n: int) -> None:
    with nats_factory() as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="s", subjects=["s"])
        for i in range(n):
            await js.publish("s", b"x", headers={"Nats-Msg-Id": f"i{i}"})
        assert sum((await stream_ids(nc, "s")).values()) == n
        await nc.close()


# --------------------------------------------------------------------------- by (id, payload)


@pytest.mark.unit
def test_payload_digest_ignores_the_id_and_key_order_but_not_the_bytes() -> None:
    from cluster.verify import payload_digest

    a = payload_digest({"id": "e1", "n": 1, "k": "a"})
    assert a == payload_digest(b'{"k":"a","n":1}') == payload_digest({"n": 1, "k": "a"})
    assert a == payload_digest(b'{"id":"other","n":1,"k":"a"}')
    assert a != payload_digest({"n": 2, "k": "a"})
    assert payload_digest(b"not json") != payload_digest(b"not json!")


@pytest.mark.unit
def test_judge_stream_counts_by_id_and_payload() -> None:
    """Fabricated inputs for each way the verdict must fail, and one clean pass."""
    from cluster.verify import judge_stream

    acked = {"a": "ha", "b": "hb", "c": "hc", "d": "hd"}
    stored = [
        ("a", "ha"),  # fine
        ("b", "hb"),
        ("b", "hb"),  # same id twice
        ("c", "hX"),  # same id, other bytes: the acknowledged payload is gone
        ("e", "hd"),  # d's payload under another id ...
        ("d", "hd"),  # ... and under its own: duplicated payload
        ("z", "hz"),  # unacknowledged, stored once: legal
        ("r", "hr"),  # a refused event that is stored anyway
    ]
    v = judge_stream("s1", acked, stored, refused=["hr", "hq"])
    assert not v.ok
    assert v.lost == [] and v.altered == ["c"]
    assert v.duplicated == {"b": 2}
    assert v.duplicated_payloads == {"hd": ["d", "e"]}
    assert v.refused_stored == ["r"]
    assert v.unexpected == 3  # e, z, r
    assert v.acknowledged == 4 and v.stored == 8

    v = judge_stream("s1", acked, [("a", "ha"), ("b", "hb"), ("c", "hc")])
    assert v.lost == ["d"] and not v.ok
    clean = judge_stream("s1", acked, [(i, h) for i, h in acked.items()], refused=["hq"])
    assert clean.ok and str(clean).startswith("s1:")


@pytest.mark.unit
def test_blind_resends_explain_a_second_copy_and_nothing_more() -> None:
    """A producer without ids whose request got no answer resent blind: one extra copy of
    that payload is explained (counted), a third is still a duplicate."""
    from cluster.verify import judge_stream

    acked = {"n2": "hp"}
    two = judge_stream("s", acked, [("n1", "hp"), ("n2", "hp")], blind={"hp": 1})
    assert two.ok and two.blind_duplicates == 1 and not two.duplicated_payloads
    three = judge_stream("s", acked, [("n1", "hp"), ("n2", "hp"), ("n3", "hp")], blind={"hp": 1})
    assert not three.ok and three.duplicated_payloads == {"hp": ["n1", "n2", "n3"]}
    # without the blind resend the same two copies are a duplicate
    assert not judge_stream("s", acked, [("n1", "hp"), ("n2", "hp")]).ok


@pytest.mark.unit
def test_judge_streams_keeps_streams_apart() -> None:
    """The same id on two streams is two events: present on one does not cover the other."""
    from cluster.verify import judge_streams

    acked = {"s1": {"x": "h1"}, "s2": {"x": "h2"}}
    stored = {"s1": [("x", "h1")], "s2": []}
    verdicts = judge_streams(acked, stored)
    assert verdicts["s1"].ok and verdicts["s2"].lost == ["x"]
    stored = {"s1": [("x", "h1")], "s2": [("x", "h1")]}  # s1's payload on s2: not s2's event
    assert judge_streams(acked, stored)["s2"].altered == ["x"]


async def test_reads_payload_digests_and_sees_an_altered_payload(
    nats_factory: NatsFactory,
) -> None:
    """Same id, different bytes: the verdict names it altered, not fine."""
    from nats.js.api import StreamConfig

    from cluster.verify import judge_stream, payload_digest, stream_records
    from runtime.waiting import await_until

    with nats_factory() as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="p", subjects=["p"], duplicate_window=1.0))
        bodies = {f"e{i}": {"id": f"e{i}", "n": i} for i in range(50)}
        for eid, body in bodies.items():
            await js.publish("p", msgspec.json.encode(body), headers={"Nats-Msg-Id": eid})
        acked = {eid: payload_digest(b) for eid, b in bodies.items()}
        assert judge_stream("p", acked, await stream_records(nc, "p")).ok
        await js.delete_msg("p", 43)  # e42, then the same id with other bytes
        forged = msgspec.json.encode({"id": "e42", "n": -1})

        async def republished() -> bool:  # once the 1 s duplicate window let it in
            ack = await js.publish("p", forged, headers={"Nats-Msg-Id": "e42"})
            return not ack.duplicate

        await await_until(republished, 30, 0.2, what="forged copy stored")
        assert judge(list(acked), await stream_ids(nc, "p")).ok  # ids alone miss it
        v = judge_stream("p", acked, await stream_records(nc, "p"))
        assert not v.ok and v.altered == ["e42"] and not v.lost and v.stored == 50, str(v)
        await nc.close()


async def test_a_tally_reads_on_from_its_last_read_and_sees_each_new_id_once(
    nats_factory: NatsFactory,
) -> None:
    with nats_factory() as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="t", subjects=["t.>"], duplicate_window=0.5)
        first: list[tuple[str, bytes]] = []
        tally = StreamTally("t", on_new=lambda eid, data: first.append((eid, data)))
        assert await tally.read(nc) == Counter()  # an empty stream
        for i in range(3000):
            await js.publish("t.a", b"%d" % i, headers={"Nats-Msg-Id": f"a{i}"})
        assert sum((await tally.read(nc)).values()) == 3000 and tally.next_seq == 3001

        # a repeat of an id outside the duplicate window (a real second copy), and new ids
        async def stored_again() -> bool:
            ack = await js.publish("t.b", b"again", headers={"Nats-Msg-Id": "a7"})
            return not ack.duplicate

        await await_until(stored_again, timeout=10, what="a7 stored a second time")
        for i in range(5):
            await js.publish("t.b", b"b%d" % i, headers={"Nats-Msg-Id": f"b{i}"})
        ids = await tally.read(nc)
        assert ids["a7"] == 2 and sum(ids.values()) == 3006, ids.most_common(2)
        assert judge([f"a{i}" for i in range(3000)], ids).duplicated == {"a7": 2}
        # the first copy of each id was seen once, in stream order; the repeat was not
        assert [eid for eid, _ in first] == [f"a{i}" for i in range(3000)] + [
            f"b{i}" for i in range(5)
        ]
        assert first[7] == ("a7", b"7")
        # nothing new: nothing read again
        before = dict(ids)
        assert await tally.read(nc) == before and tally.next_seq == 3007
        await nc.close()
