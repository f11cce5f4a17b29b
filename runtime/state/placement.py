"""Where the next replica of a role goes: the alive node holding the fewest of its replicas.

Pure policy, apart from Ray: `spread_node` decides from counts, `plan` lays out a whole role
at start, `affinity` records a choice in a child's Ray options as a hint, and the
supervisor turns the hint into a hard node affinity when it creates the actor
(`resolve`). Hard, because Ray's soft affinity was seen to put three replicas on one node
of three; and a hint, because a hard affinity to a node that died makes the actor
unschedulable: the supervisor then re-plans onto a live node (`resolve` again), so a node
loss costs a restart, never a replica that cannot run. Loggers do not use this; their
k+1 copies get a STRICT_SPREAD placement group (`runtime/state/replication.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def spread_node(counts: Mapping[str, int], alive: Sequence[str]) -> str | None:
    """The alive node with the fewest replicas of the role (first in `alive` on ties), or
    None when there is no choice to make (fewer than two alive nodes)."""
    if len(alive) < 2:
        return None
    return min(alive, key=lambda n: (counts.get(n, 0), alive.index(n)))


def plan(
    replicas: int, alive: Sequence[str], placed: Iterable[str | None] = ()
) -> list[str | None]:
    """Nodes for `replicas` new replicas of one role, given where its others already run."""
    counts: Counter[str] = Counter(n for n in placed if n)
    out: list[str | None] = []
    for _ in range(replicas):
        node = spread_node(counts, alive)
        out.append(node)
        if node:
            counts[node] += 1
    return out


NODE_HINT = "tierflow_node"


def affinity(node: str | None) -> dict[str, Any]:
    """The placement hint for a child's `ray_options`; empty for no preference."""
    return {NODE_HINT: node} if node else {}


def resolve(hint: str | None, alive: Sequence[str], siblings: Iterable[str | None]) -> str | None:
    """The node to create a replica on: its hinted node while alive, else the live node
    with the fewest `siblings` (the hints of the role's other replicas)."""
    if hint and hint in alive:
        return hint
    return plan(1, alive, siblings)[0] if hint else None


def strategy(node: str | None) -> dict[str, Any]:
    """Ray options pinning an actor to `node` (hard); empty for no preference."""
    if not node:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def alive_nodes() -> list[str]:
    """Ids of the alive Ray nodes that can host actors, in a stable order."""
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def actor_nodes(handles: Mapping[str, Any], timeout_s: float = 10.0) -> dict[str, str | None]:
    """name -> node id of each supervised actor (None if it does not answer in time)."""
    import ray

    refs = {name: h.heartbeat.remote() for name, h in handles.items()}
    out: dict[str, str | None] = {}
    for name, ref in refs.items():
        try:
            out[name] = ray.get(ref, timeout=timeout_s)["node_id"]
        except Exception:  # restarting, or gone: it holds no place
            out[name] = None
    return out


def next_index(names: list[str], role: str) -> int:
    """The lowest replica number of `role` not in `names` (names are `<role>-<n>`)."""
    used = {int(n.rsplit("-", 1)[1]) for n in names}
    return next(i for i in range(len(used) + 1) if i not in used)
