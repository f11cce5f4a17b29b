"""Which replicas of a logger group a write needs: pure policy, no Ray.

A group of k+1+e replicas acknowledges a write once every replica of its in-sync set
holds it, and that set never has fewer than k+1 members, so an acknowledged event
survives k losses. With e = 0 the set is every replica (a lost replica stops writes until
Ray or an operator replaces it). With e >= 1 a holder that sees in-sync replicas stop
answering drops them from the set under a new epoch, and writes go on at once on the
k+1 or more left: Kafka's in-sync replicas with `min.insync.replicas = k+1`.

Two holders may decide at once, on two sides of a partition. An epoch names one
configuration (`Fence.advance` refuses a second one), a new set is a subset of the one
it replaces, and any two sets of k+1 or more out of k+1+e replicas share a replica when
e <= k, so at most one of two rival sets for an epoch is accepted by all its members;
holders use only such a complete configuration (`newest`). A replica outside the set
missed writes: it counts again only after a full copy from the primary (`LoggerGroup`'s
`heal`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class Config(NamedTuple):
    epoch: int
    primary: int
    in_sync: tuple[int, ...] | None  # None: every replica


def extra_replicas(setting: int | str, k: int, nodes: int) -> int:
    """How many replicas beyond k+1 a group gets: `setting` as given, or for "auto" one
    when k >= 1 and the cluster has a node for each of k+2 replicas (several hosts: a
    host's loss or cut leaves writes going), else none (one machine: a replica more would
    only cost a copy of every write)."""
    if setting != "auto":
        return int(setting)
    return 1 if k >= 1 and nodes >= k + 2 else 0


def members(config: Config, size: int) -> tuple[int, ...]:
    return tuple(range(size)) if config.in_sync is None else config.in_sync


def _of(status: Mapping[str, Any]) -> Config | None:
    if status.get("error") or status.get("primary") is None:
        return None
    in_sync = status.get("in_sync")
    return Config(
        int(status["epoch"]),
        int(status["primary"]),
        None if in_sync is None else tuple(sorted(in_sync)),
    )


def newest(statuses: Sequence[Mapping[str, Any]], size: int) -> Config | None:
    """The newest configuration the replicas' statuses (index = replica) show whole.

    An explicit in-sync set counts only when every member reports it (it was accepted by
    all, so it is the only one of its epoch). A configuration of every replica counts when
    the replicas reporting its epoch agree: its writes need all of them anyway. Older
    epochs are looked at when the newest is split or not confirmed yet."""
    configs = [_of(s) for s in statuses]
    for epoch in sorted({c.epoch for c in configs if c is not None}, reverse=True):
        at = {c for c in configs if c is not None and c.epoch == epoch}
        if len(at) != 1:
            continue  # rival announcements for one epoch: neither is whole
        (config,) = at
        if config.in_sync is None or all(
            i < len(configs) and configs[i] == config for i in config.in_sync
        ):
            return config
    return None


def without(
    config: Config, lost: Sequence[int], size: int, need: int, catching_up: Sequence[int] = ()
) -> Config | None:
    """The configuration of the next epoch without replicas `lost`, or None when fewer than
    `need` would remain or no caught-up replica would be left to lead. The primary stays
    when it is not lost; otherwise the lowest caught-up member leads."""
    kept = tuple(i for i in members(config, size) if i not in set(lost))
    if len(kept) < need:
        return None
    leaders = [i for i in kept if i not in set(catching_up)]
    if not leaders:
        return None
    primary = config.primary if config.primary in leaders else leaders[0]
    return Config(config.epoch + 1, primary, kept)


def with_(config: Config, joining: int, size: int) -> Config:
    """The configuration of the next epoch with replica `joining` back in the set."""
    kept = set(members(config, size)) | {joining}
    return Config(config.epoch + 1, config.primary, tuple(sorted(kept)))
