"""The chaos scenarios `tierflow chaos run --scenario NAME` knows, by name."""

from __future__ import annotations

from cluster.chaos.schedule import (
    ACK_LOSS,
    DISK_ERROR,
    DISK_FULL,
    KILL,
    KILL_REPEAT,
    LATENCY,
    NATS_DOWN,
    NATS_NODE,
    PAUSE,
    RAY_NODE,
    RESETS,
    ROLE_TARGETS,
    Fault,
    Scenario,
    plan,
)

# Kills past the collection supervisor's restart intensity (20 restarts in 60 s): both
# collectors and the bridge at once, round after round, so the restarts land inside 60 s.
KILLS_PAST_INTENSITY = 30
# A duplicate window shorter than the outage of `nats-down-past-dup-window`.
SHORT_DUP_WINDOW_S = 4.0
# Two NATS sites, not one deployment: the runner hands these to cluster/chaos/site_loss*.py.
SITE_LOSS = "site-loss"  # HTTP into a tierflow runtime per site (site_loss_pipeline.py)
SITE_LOSS_NATS = "site-loss-nats"  # JetStream publishes straight to each site (site_loss.py)
# Their schedule, said in words (the kill is not a `schedule.Fault`: it needs two sites).
SITE_SCHEDULES = {
    SITE_LOSS: "0.40: every node of site A SIGKILLed (A's collector keeps logging); "
    "A restarted on its stores once the load ends",
    SITE_LOSS_NATS: "0.40 - 0.5 s: the link between the sites cut; 0.40: every node of "
    "site A SIGKILLed, its producer moves to B; A restarted once the load ends",
}

_ALL = (
    Scenario(
        "kill-each-role",
        "SIGKILL one replica of every role in turn: both collectors, the bridge, the "
        "logger primary and backup, a gateway",
        tuple(Fault(0.1 + 0.12 * i, KILL, t) for i, t in enumerate(ROLE_TARGETS)),
        min_span_s=12.0,
    ),
    Scenario(
        "kill-logger-primary",
        "SIGKILL the logger group's primary replica twice",
        (Fault(0.25, KILL, "logger-primary"), Fault(0.6, KILL, "logger-primary")),
    ),
    Scenario(
        "kill-logger-backup",
        "SIGKILL the logger group's backup replica twice",
        (Fault(0.25, KILL, "logger-backup"), Fault(0.6, KILL, "logger-backup")),
    ),
    Scenario(
        "kill-past-intensity",
        f"up to {KILLS_PAST_INTENSITY} kills of the collectors and the bridge, round after "
        "round: the supervisor escalates and stops the tier; the operator's restart "
        "replays the message log",
        (Fault(0.1, KILL_REPEAT, "collection", count=KILLS_PAST_INTENSITY),),
        min_span_s=30.0,
    ),
    Scenario(
        "ray-node-loss",
        "remove the Ray node hosting the logger backup (3-node ray.cluster_utils cluster), "
        "then add a replacement node",
        (Fault(0.3, RAY_NODE, "logger-backup"),),
        min_span_s=12.0,
        ray_nodes=3,
    ),
    Scenario(
        "nats-r3-node-loss",
        "SIGKILL the stream leader of a 3-node JetStream cluster (R3) for 8 s",
        (Fault(0.3, NATS_NODE, "nats", 8.0),),
        min_span_s=12.0,
        nats_nodes=3,
    ),
    Scenario(
        "nats-down-10s",
        "SIGKILL the only nats-server, restart it 10 s later",
        (Fault(0.3, NATS_DOWN, "nats", 10.0),),
    ),
    Scenario(
        "nats-down-past-dup-window",
        f"streams with a {SHORT_DUP_WINDOW_S:g} s duplicate window; the only nats-server "
        "down for 10 s, longer than the window: a blind resend past it would store twice",
        (Fault(0.3, NATS_DOWN, "nats", 10.0),),
        min_span_s=16.0,
        duplicate_window_s=SHORT_DUP_WINDOW_S,
    ),
    Scenario(
        "acks-lost-past-dup-window",
        f"streams with a {SHORT_DUP_WINDOW_S:g} s duplicate window; for 10 s the link from "
        "NATS to the collection tier drops everything (TCP proxy): publishes are stored, "
        "their acks never arrive, and a blind resend past the window would store twice",
        (Fault(0.3, ACK_LOSS, "link", 10.0),),
        min_span_s=16.0,
        proxy=True,
        duplicate_window_s=SHORT_DUP_WINDOW_S,
    ),
    Scenario(
        "pause-each-role",
        "SIGSTOP each role's process for 3 s in turn, then SIGCONT",
        tuple(Fault(0.05 + 0.14 * i, PAUSE, t, 3.0) for i, t in enumerate(ROLE_TARGETS)),
        min_span_s=24.0,
    ),
    Scenario(
        "link-latency-resets",
        "between the collection tier and NATS (TCP proxy): 200 ms +- 100 latency for 4 s, "
        "then every connection reset for 3 s",
        (Fault(0.2, LATENCY, "link", 4.0), Fault(0.6, RESETS, "link", 3.0)),
        min_span_s=12.0,
        proxy=True,
    ),
    Scenario(
        "logger-disk-errors",
        "LevelDB write errors (EIO) on the logger backup for 3 s, then a full disk "
        "(ENOSPC) on the primary for 3 s",
        (
            Fault(0.2, DISK_ERROR, "logger-backup", 3.0),
            Fault(0.6, DISK_FULL, "logger-primary", 3.0),
        ),
        min_span_s=12.0,
    ),
    Scenario(
        "spark-driver-kill",
        "SIGKILL the Spark driver actor twice while it runs the Meetup analyses; results "
        "must equal an exact recomputation over the stream",
        (Fault(0.3, KILL, "driver"), Fault(0.65, KILL, "driver")),
        min_span_s=20.0,
        analysis=True,
    ),
    Scenario(
        "nemesis",
        "Jepsen-style nemesis: 10 random kills, pauses, NATS outages and disk faults over 40 s",
        nemesis_faults=10,
        min_span_s=40.0,
    ),
    Scenario(
        SITE_LOSS,
        "two NATS sites of 3 nodes (a stream R3 copied both ways), a tierflow runtime on "
        "each (collector, logger k=1, bridge), HTTP load into both, 1 in 50 of A's events "
        "also sent to B: every node of site A SIGKILLed under load, A restarted after; "
        "every acknowledged event once in both copies (docs/geo.md)",
        min_span_s=0.0,
        nats_nodes=3,
        gateway=False,
    ),
    Scenario(
        SITE_LOSS_NATS,
        "site-loss at the NATS layer: JetStream publishes with ids to each site, the link "
        "cut just before site A is killed, A's producer resends to B (docs/geo.md)",
        min_span_s=0.0,
        nats_nodes=3,
        gateway=False,
    ),
)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in _ALL}
# The short form `make test` runs (each well under a minute at small N).
SHORT = ("kill-each-role", "logger-disk-errors", "nats-down-10s", "acks-lost-past-dup-window")


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        known = ", ".join(SCENARIOS)
        raise KeyError(f"unknown scenario {name!r}; known: {known}, all") from None


def schedule_text(scn: Scenario, seed: int) -> str:
    """What `tierflow chaos list` shows as the scenario's schedule for `seed`."""
    if scn.name in SITE_SCHEDULES:
        return SITE_SCHEDULES[scn.name]
    return ", ".join(f"{f.at:.2f}: {f.label}" for f in plan(scn, seed))


def resolve(name: str) -> list[Scenario]:
    """`all` or one name -> the scenarios to run, in order."""
    return list(SCENARIOS.values()) if name == "all" else [get(name)]
