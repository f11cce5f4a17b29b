"""The zero-loss verifier must see real losses and duplicates, not just pass."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from runtime.nats import NatsServer, connect
from runtime.verify import judge, stream_ids


def test_judge_pure() -> None:
    stored = Counter({"a": 1, "b": 2, "x": 1})
    v = judge(["a", "b", "c"], stored)
    assert not v.ok
    assert v.lost == ["c"] and v.duplicated == {"b": 2} and v.unexpected == 1
    assert judge(["a"], Counter({"a": 1})).ok


async def test_reads_every_id_and_sees_a_deleted_message(tmp_path: Path) -> None:
    with NatsServer(store_dir=tmp_path / "n").start() as server:
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
async def test_small_streams(tmp_path: Path, n: int) -> None:
    with NatsServer(store_dir=tmp_path / "n").start() as server:
        nc = await connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="s", subjects=["s"])
        for i in range(n):
            await js.publish("s", b"x", headers={"Nats-Msg-Id": f"i{i}"})
        assert sum((await stream_ids(nc, "s")).values()) == n
        await nc.close()
