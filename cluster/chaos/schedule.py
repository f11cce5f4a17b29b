"""Chaos schedules: which faults hit which targets, and when. Pure policy, no I/O.

A schedule is a function of (scenario, seed) only: `plan(scenario, seed)` gives the same
faults for the same pair in every process (the RNG is seeded from a string, which does
not depend on PYTHONHASHSEED). Fault times are fractions of the load window, so the same
schedule fits a short or a long run; `at_s(fault, span_s)` turns one into seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

# What an injector can do (cluster.chaos.injectors dispatches on these).
KILL = "kill"  # SIGKILL the target's process; Ray restarts it
KILL_REPEAT = "kill_repeat"  # `count` kills in a row, past the supervisor's restart intensity
PAUSE = "pause"  # SIGSTOP for duration_s, then SIGCONT
NATS_DOWN = "nats_down"  # SIGKILL nats-server (single node), restart after duration_s
NATS_NODE = "nats_node"  # SIGKILL one node of an R3 cluster (the stream leader), restart
RAY_NODE = "ray_node"  # remove the Ray node hosting the target, add a replacement
DISK_ERROR = "disk_error"  # the logger replica's LevelDB writes fail with EIO
DISK_FULL = "disk_full"  # ... with ENOSPC
LATENCY = "latency"  # proxy between collection tier and NATS: added latency
RESETS = "resets"  # proxy: every connection is reset while active
ACK_LOSS = "ack_loss"  # proxy: server-to-client bytes dropped (stored, never acknowledged)

ACTIONS = (
    KILL,
    KILL_REPEAT,
    PAUSE,
    NATS_DOWN,
    NATS_NODE,
    RAY_NODE,
    DISK_ERROR,
    DISK_FULL,
    LATENCY,
    RESETS,
    ACK_LOSS,
)
# Targets: role replicas ("collector-0"), the logger group's current primary or backup,
# "gateway-client" (the gateway replica serving the run's subscriber), "driver" (the Spark
# driver actor), "nats", "link" (the proxy).
ROLE_TARGETS = (
    "collector-0",
    "collector-1",
    "bridge-0",
    "logger-primary",
    "logger-backup",
    "gateway-client",
)


@dataclass(frozen=True)
class Fault:
    """One fault: `at` is a fraction (0..1) of the load window; bounded by `duration_s`
    (a time) and `count` (kills)."""

    at: float
    action: str
    target: str
    duration_s: float = 0.0
    count: int = 1

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}")
        if not 0.0 <= self.at <= 1.0 or self.duration_s < 0 or self.count < 1:
            raise ValueError(f"fault out of bounds: {self}")

    @property
    def label(self) -> str:
        extra = f" x{self.count}" if self.count > 1 else ""
        extra += f" {self.duration_s:g}s" if self.duration_s else ""
        return f"{self.action} {self.target}{extra}"


@dataclass(frozen=True)
class Scenario:
    """A named set of faults plus the deployment they need.

    `nemesis_faults` > 0 adds that many random faults (Jepsen's nemesis) drawn from
    `NEMESIS_MENU`; `min_span_s` is the shortest load window the faults need (the runner
    slows the load to fit); `analysis` runs the Spark driver and checks its results;
    `duplicate_window_s` > 0 shortens the load streams' JetStream duplicate window (to
    run an outage past it).
    """

    name: str
    summary: str
    faults: tuple[Fault, ...] = ()
    nemesis_faults: int = 0
    min_span_s: float = 8.0
    nats_nodes: int = 1
    ray_nodes: int = 1
    proxy: bool = False
    gateway: bool = True
    analysis: bool = False
    duplicate_window_s: float = 0.0


# Random faults a nemesis may pick: each short and self-undoing, safe to overlap.
NEMESIS_MENU: tuple[tuple[str, str, float], ...] = (
    (KILL, "collector-0", 0.0),
    (KILL, "collector-1", 0.0),
    (KILL, "bridge-0", 0.0),
    (KILL, "logger-primary", 0.0),
    (KILL, "logger-backup", 0.0),
    (KILL, "gateway-client", 0.0),
    (PAUSE, "collector-0", 2.0),
    (PAUSE, "bridge-0", 2.0),
    (PAUSE, "logger-backup", 2.0),
    (NATS_DOWN, "nats", 3.0),
    (DISK_ERROR, "logger-backup", 2.0),
    (DISK_FULL, "logger-primary", 2.0),
)

JITTER = 0.05  # fixed faults move by up to this fraction of the window, per seed


def _rng(scenario: str, seed: int) -> random.Random:
    return random.Random(f"tierflow-chaos:{scenario}:{seed}")


def plan(scenario: Scenario, seed: int) -> tuple[Fault, ...]:
    """The scenario's faults for `seed`, sorted by time: its fixed faults moved by a
    seeded jitter, then `nemesis_faults` random ones in the window's middle 80%."""
    rng = _rng(scenario.name, seed)
    out = []
    for f in scenario.faults:
        at = min(0.9, max(0.05, f.at + rng.uniform(-JITTER, JITTER)))
        out.append(replace(f, at=round(at, 4)))
    for _ in range(scenario.nemesis_faults):
        action, target, duration = rng.choice(NEMESIS_MENU)
        out.append(Fault(round(rng.uniform(0.1, 0.9), 4), action, target, duration))
    return tuple(sorted(out, key=lambda f: (f.at, f.action, f.target)))


def at_s(fault: Fault, span_s: float) -> float:
    """Seconds after the load started at which `fault` begins."""
    return fault.at * span_s


def load_span(events: int, rate: float, scenario: Scenario) -> tuple[float, float]:
    """(window seconds, events/s) for a run: `events` at `rate`, slowed when the scenario
    needs a longer window than that (faults must land while the load runs)."""
    if events < 1 or rate <= 0:
        raise ValueError("events must be >= 1 and rate > 0")
    span = max(events / rate, scenario.min_span_s)
    return span, events / span
