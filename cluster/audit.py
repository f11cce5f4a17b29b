"""`tierflow audit`: read back every stream of a running tierflow and judge what it holds.

A chaos run proves nothing acknowledged was lost against the ids its own producer was told
were accepted (cluster/verify.py); a running pipeline's producers are strangers, so an audit
judges what the stream alone can show: no event id stored twice (the duplicate window and
the idempotent bridge held), how many events carry no id. The verdict goes to the console
(the ``verifier`` key of the status bucket, runtime/nats/roles.py) and to the terminal.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgspec

from runtime.nats.roles import VERIFIER_KEY

__all__ = ["audit", "judge_audit"]

SYSTEM = ("results", "deadletter")
NO_ID = "<no id, seq "  # cluster/verify.py's placeholder for a message without one


def judge_audit(ids: Mapping[str, Counter[str]], no_id: Mapping[str, int]) -> dict[str, Any]:
    """The audit's verdict over each stream's id counts (pure): ``ok`` when no id occurs
    twice in any stream (ids repeat freely across streams: two streams, two events)."""
    streams = {}
    for name, found in sorted(ids.items()):
        twice = sorted(i for i, n in found.items() if n > 1)
        streams[name] = {
            "events": sum(found.values()) + int(no_id.get(name, 0)),
            "without_id": int(no_id.get(name, 0)),
            "ids_stored_twice": len(twice),
            "examples": twice[:5],
        }
    bad = [n for n, s in streams.items() if s["ids_stored_twice"]]
    return {
        "kind": "audit",
        "at": time.time(),
        "verdict": "ok" if not bad else "duplicates",
        "why": "" if not bad else f"ids stored twice in {', '.join(bad)}",
        "streams": streams,
    }


async def audit(nc: Any, streams: list[str], timeout: float = 300.0) -> dict[str, Any]:
    """Read `streams` whole, judge them, and put the verdict where the console reads it."""
    from cluster.console.feed import status_bucket
    from cluster.verify import stream_ids

    ids: dict[str, Counter[str]] = {}
    no_id: dict[str, int] = {}
    for name in streams:
        found = await stream_ids(nc, name, timeout=timeout)
        placeholders = [i for i in found if i.startswith(NO_ID)]  # one per message, unique
        no_id[name] = len(placeholders)
        for i in placeholders:
            del found[i]
        ids[name] = found
    verdict = judge_audit(ids, no_id)
    kv = await status_bucket(nc.jetstream())
    await kv.put(VERIFIER_KEY, msgspec.json.encode(verdict))
    return verdict
