"""The lab's nemesis: network and host faults on a schedule fixed by a seed (Jepsen's word
for what breaks the system under test).

`plan(kinds, hosts, seed)` is pure: the same faults, on the same hosts, at the same
fractions of the load window, in every process. A fault names its hosts, or a role
(``role:nats-leader``, ``role:ray-head`` ...) that `resolve` turns into the host holding it
when the fault is applied, since which host leads a stream is known only then.
`apply(lab, fault, ...)` does it and undoes it, and says when (`Marks`): the time from the
fault to the next acknowledged write and from the heal to full throughput are measured
against those marks by `recovery`, also pure.
"""

from __future__ import annotations

import asyncio
import bisect
import random
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cluster.lab.hosts import Lab

__all__ = [
    "BRIDGE_PARTITION",
    "FLAKY_LINK",
    "HOST_CRASH",
    "HOST_PAUSE",
    "KINDS",
    "PARTITION_HOST",
    "PARTITION_MINORITY",
    "LabFault",
    "Marks",
    "Recovery",
    "apply",
    "plan",
    "recovery",
    "resolve",
]

PARTITION_HOST = "partition-host"  # one host's link down, then up
PARTITION_MINORITY = "partition-minority"  # one host cut from the others; the laptop sees both
BRIDGE_PARTITION = "bridge-partition"  # the hosts in two groups that cannot see each other
HOST_CRASH = "host-crash"  # SIGKILL every process of a host; its engines restarted after
HOST_PAUSE = "host-pause"  # SIGSTOP every process of a host, SIGCONT after
FLAKY_LINK = "flaky-link"  # a host's link down and up again and again (no netem here)
KINDS = (PARTITION_HOST, PARTITION_MINORITY, BRIDGE_PARTITION, HOST_CRASH, HOST_PAUSE, FLAKY_LINK)
DURATION_S = {
    PARTITION_HOST: 30.0,
    PARTITION_MINORITY: 30.0,
    BRIDGE_PARTITION: 30.0,
    HOST_CRASH: 10.0,
    HOST_PAUSE: 20.0,
    FLAKY_LINK: 60.0,
}
FLAKY_PERIOD_S = 2.0  # a flaky link is down this long, then up this long
ROLE = "role:"


@dataclass(frozen=True)
class LabFault:
    """`kind` on `hosts` (names, or one ``role:<name>``) at fraction `at` of the window,
    lasting `duration_s`."""

    at: float
    kind: str
    hosts: tuple[str, ...]
    duration_s: float

    @property
    def label(self) -> str:
        return f"{self.kind} {'+'.join(self.hosts)} {self.duration_s:g}s"


def plan(
    kinds: Sequence[str],
    hosts: Sequence[str],
    seed: int,
    *,
    roles: Sequence[str] = (),
    durations: Mapping[str, float] | None = None,
) -> list[LabFault]:
    """One fault of each kind, in order, spread over the window (the first at 0.15, the
    last by 0.6), each on a host the seed picks: among `hosts`, or one of `roles` when
    given. A bridge partition splits off one host chosen by the seed from the rest."""
    if not hosts:
        raise ValueError("a plan needs hosts")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown lab faults {unknown}; known: {', '.join(KINDS)}")
    rng = random.Random(f"lab-nemesis:{seed}")
    lengths = {**DURATION_S, **(durations or {})}
    out = []
    step = 0.45 / max(1, len(kinds) - 1) if len(kinds) > 1 else 0.0
    for i, kind in enumerate(kinds):
        if kind == BRIDGE_PARTITION:
            alone = rng.choice(list(hosts))
            target: tuple[str, ...] = (alone,)
        elif roles:
            target = (ROLE + rng.choice(list(roles)),)
        else:
            target = (rng.choice(list(hosts)),)
        out.append(LabFault(round(0.15 + step * i, 3), kind, target, lengths[kind]))
    return out


def resolve(fault: LabFault, holders: Mapping[str, str]) -> tuple[str, ...]:
    """The hosts `fault` hits: its own, or the host holding its role now (`holders`:
    role -> host); KeyError naming the role when nobody holds it."""
    out = []
    for h in fault.hosts:
        if h.startswith(ROLE):
            role = h.removeprefix(ROLE)
            if role not in holders:
                raise KeyError(f"no host holds {role!r} now (known: {sorted(holders)})")
            out.append(holders[role])
        else:
            out.append(h)
    return tuple(out)


@dataclass
class Marks:
    """When a fault began and when it was healed (time.monotonic())."""

    fault: str
    hosts: tuple[str, ...]
    began: float = 0.0
    healed: float = 0.0


async def apply(
    lab: Lab,
    fault: LabFault,
    hosts: tuple[str, ...],
    *,
    restart: Callable[[str], None] | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> Marks:
    """Do `fault` on `hosts`, wait its duration, undo it. `restart(host)` brings a crashed
    host's engines back on their own state (`LabCluster.restart_host`)."""
    marks = Marks(fault.kind, hosts)
    run = asyncio.to_thread
    marks.began = time.monotonic()
    if fault.kind == PARTITION_HOST:
        for h in hosts:
            await run(lab.link, h, False)
        await sleep(fault.duration_s)
        for h in hosts:
            await run(lab.link, h, True)
    elif fault.kind in (PARTITION_MINORITY, BRIDGE_PARTITION):
        await run(lab.isolate, list(hosts))
        await sleep(fault.duration_s)
        await run(lab.rejoin, list(hosts))
    elif fault.kind == HOST_CRASH:
        for h in hosts:
            await run(lab.signal_host, h, signal.SIGKILL)
        await sleep(fault.duration_s)
        for h in hosts:
            if restart is not None:
                await run(restart, h)
    elif fault.kind == HOST_PAUSE:
        for h in hosts:
            await run(lab.signal_host, h, signal.SIGSTOP)
        await sleep(fault.duration_s)
        for h in hosts:
            await run(lab.signal_host, h, signal.SIGCONT)
    elif fault.kind == FLAKY_LINK:
        flips = max(1, int(fault.duration_s / (2 * FLAKY_PERIOD_S)))
        for _ in range(flips):
            for h in hosts:
                await run(lab.link, h, False)
            await sleep(FLAKY_PERIOD_S)
            for h in hosts:
                await run(lab.link, h, True)
            await sleep(FLAKY_PERIOD_S)
    else:
        raise ValueError(f"unknown lab fault {fault.kind!r}")
    marks.healed = time.monotonic()
    return marks


@dataclass(frozen=True)
class Recovery:
    """What a fault cost the writers: seconds from the fault to the next acknowledgement
    (None: none during or after it), and from the heal until acknowledgements ran at the
    pre-fault rate again (None: never within the run)."""

    to_next_ack_s: float | None
    to_full_rate_s: float | None
    rate_before: float = 0.0
    acks_during: int = 0
    notes: list[str] = field(default_factory=list)


def recovery(
    acks: Sequence[float], marks: Marks, *, window_s: float = 5.0, share: float = 0.9
) -> Recovery:
    """From acknowledgement times (monotonic, any order) and a fault's marks. The pre-fault
    rate is that of the `window_s` before the fault; full rate again is the first window
    after the heal whose rate reaches `share` of it."""
    times = sorted(acks)
    before = [t for t in times if marks.began - window_s <= t < marks.began]
    rate = len(before) / window_s
    after = [t for t in times if t > marks.began]
    to_next = (after[0] - marks.began) if after else None
    during = sum(1 for t in times if marks.began <= t < marks.healed)
    to_full = None
    if rate > 0:
        first = bisect.bisect_left(times, marks.healed)
        for i in range(first, len(times)):
            in_window = bisect.bisect_left(times, times[i] + window_s) - i
            if in_window / window_s >= share * rate:
                to_full = times[i] - marks.healed
                break
    return Recovery(to_next, to_full, rate, during)
