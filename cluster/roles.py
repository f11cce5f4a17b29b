"""What each role's replicas report, for `tierflow status`, /metrics and the autoscaler.

`RoleView.snapshot()` asks every replica of every role for its figures (Ray calls, each
bounded in time; a replica that does not answer is a row with an error, never a hang).
`load(role, snapshot)` is the one number per role the autoscaling policy scales on, and
`rates(...)` turns two snapshots' counters into per-second rates. Both are pure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

# The load figure of each role (the unit of its `target_per_replica`).
LOAD_FIELD = {
    "collector": "requests_in_flight",  # HTTP requests in hand
    "logger": "pending",  # logged entries JetStream does not hold yet
    "bridge": "in_flight",  # publishes awaiting their JetStream ack
    "gateway": "clients",  # open WebSocket and SSE connections
}
# Counters turned into rates between two snapshots.
RATE_FIELDS = {
    "collector": ("accepted", "rejected", "overloaded"),
    "logger": ("logged",),
    "bridge": ("published", "replayed", "failed"),
    "gateway": ("events_sent", "lag_warnings", "dropped"),
}


def load(role: str, replicas: Sequence[Mapping[str, Any]]) -> float:
    """The role's whole load: its field summed over the replicas that answered."""
    field = LOAD_FIELD[role]
    return float(sum(r.get(field) or 0 for r in replicas if "error" not in r))


def rates(
    prev: Mapping[str, Sequence[Mapping[str, Any]]],
    cur: Mapping[str, Sequence[Mapping[str, Any]]],
    dt: float,
) -> dict[str, dict[str, float]]:
    """Per role, per counter: events per second between two snapshots. A replica that
    restarted (its counter went down) counts from zero; one that is new counts whole."""
    out: dict[str, dict[str, float]] = {}
    if dt <= 0:
        return out
    for role, fields in RATE_FIELDS.items():
        before = {r["name"]: r for r in prev.get(role, ()) if "error" not in r}
        role_rates: dict[str, float] = {}
        for f in fields:
            total = 0.0
            for r in cur.get(role, ()):
                if "error" in r:
                    continue
                now, then = r.get(f) or 0, (before.get(r["name"]) or {}).get(f) or 0
                total += now - then if now >= then else now
            role_rates[f] = round(total / dt, 2)
        out[role] = role_rates
    return out


class RoleView:
    """Reads the running replicas of a collection tier and a set of gateways."""

    def __init__(self, namespace: str, tier: Any, gateways: Sequence[str]) -> None:
        self.namespace = namespace
        self.tier = tier
        self.gateways = gateways  # the live list the runtime resizes

    def replicas(self, role: str) -> int:
        if role == "gateway":
            return len(self.gateways)
        if role == "logger":
            return len(self.tier.loggers)
        return len(getattr(self.tier, f"{role}s"))

    def snapshot(self, timeout_s: float = 5.0) -> dict[str, list[dict[str, Any]]]:
        """role -> one row per replica: name, node, pid, and its role's figures."""
        # Imported here: `tierflow status` reads LOAD_FIELD from this module and must not
        # pay for loading Ray (about a second); only the runtime itself snapshots.
        import ray

        def ask(names: Sequence[str]) -> list[tuple[str, Any, Any]]:
            calls = []
            for name in names:
                try:
                    h = ray.get_actor(name, namespace=self.namespace)
                    calls.append((name, h.stats.remote(), h.heartbeat.remote()))
                except ValueError as err:
                    calls.append((name, err, None))
            return calls

        asked = {
            "collector": ask(list(self.tier.collectors) if self.tier else []),
            "bridge": ask(list(self.tier.bridges) if self.tier else []),
            "gateway": ask(list(self.gateways)),
        }
        out: dict[str, list[dict[str, Any]]] = {}
        for role, calls in asked.items():
            rows = []
            for name, stats_ref, hb_ref in calls:
                if isinstance(stats_ref, BaseException):
                    rows.append({"name": name, "error": repr(stats_ref)})
                    continue
                try:
                    stats = ray.get(stats_ref, timeout=timeout_s)
                    hb = ray.get(hb_ref, timeout=timeout_s)
                except Exception as err:  # restarting or hung: shown, not waited for
                    rows.append({"name": name, "error": type(err).__name__})
                    continue
                row = {"name": name, "node": hb.get("node_id"), "pid": hb.get("pid"), **stats}
                if role == "gateway":
                    opened = stats.get("open") or {}
                    row["clients"] = int(opened.get("ws", 0)) + int(opened.get("sse", 0))
                rows.append(scalars(row))
            out[role] = rows
        out["logger"] = self._loggers(timeout_s) if self.tier else []
        return out

    def _loggers(self, timeout_s: float) -> list[dict[str, Any]]:
        async def gather() -> list[dict[str, Any]]:
            rows = []
            for group in self.tier.loggers:
                try:
                    c = await asyncio.wait_for(group.counts(), timeout_s)
                    rows.append(
                        {
                            "name": group.name,
                            "pending": int(c.get("transient", 0)) + int(c.get("failed", 0)),
                            **c,
                        }
                    )
                except Exception as err:
                    rows.append({"name": group.name, "error": type(err).__name__})
            return rows

        return asyncio.run(gather())


def scalars(row: Mapping[str, Any]) -> dict[str, Any]:
    """Only scalars: nested figures (a gateway's feeds, cursors) stay in its own stats."""
    return {k: v for k, v in row.items() if isinstance(v, str | int | float | bool) or v is None}
