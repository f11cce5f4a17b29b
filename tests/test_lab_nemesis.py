"""The lab nemesis's pure parts: schedules fixed by a seed, roles resolved to hosts, and
what a fault cost the writers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.lab.nemesis import (
    BRIDGE_PARTITION,
    HOST_CRASH,
    KINDS,
    PARTITION_HOST,
    LabFault,
    Marks,
    plan,
    recovery,
    resolve,
)

HOSTS = ["h1", "h2", "h3"]


@pytest.mark.unit
def test_a_seed_gives_the_same_plan_and_another_seed_may_not() -> None:
    one = plan(KINDS, HOSTS, seed=7)
    assert one == plan(KINDS, HOSTS, seed=7)
    assert [f.kind for f in one] == list(KINDS)
    assert all(0.15 <= f.at <= 0.6 for f in one)
    assert [f.at for f in one] == sorted(f.at for f in one)
    assert {plan(KINDS, HOSTS, seed=s)[0].hosts for s in range(30)} == {(h,) for h in HOSTS}


def test_the_plan_is_the_same_in_another_process() -> None:
    """Seeded from a string, so PYTHONHASHSEED changes nothing (a process of its own)."""
    code = (
        "from cluster.lab.nemesis import plan, KINDS\n"
        "print([f.label for f in plan(KINDS, ['h1', 'h2', 'h3'], seed=11)])"
    )
    here = str([f.label for f in plan(KINDS, HOSTS, seed=11)])
    env = {"PYTHONHASHSEED": "123", "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == here, out.stderr


@pytest.mark.unit
def test_roles_are_resolved_to_the_host_holding_them_when_applied() -> None:
    faults = plan([PARTITION_HOST, HOST_CRASH], HOSTS, seed=3, roles=["nats-leader", "ray-head"])
    assert all(f.hosts[0].startswith("role:") for f in faults)
    holders = {"nats-leader": "h2", "ray-head": "h1"}
    assert {resolve(f, holders)[0] for f in faults} <= {"h1", "h2"}
    with pytest.raises(KeyError, match="spark-driver"):
        resolve(LabFault(0.2, PARTITION_HOST, ("role:spark-driver",), 1.0), holders)
    bridge = plan([BRIDGE_PARTITION], HOSTS, seed=3, roles=["nats-leader"])[0]
    assert bridge.hosts[0] in HOSTS  # a split is of hosts, whatever the roles


@pytest.mark.unit
def test_unknown_faults_and_empty_labs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown lab faults"):
        plan(["unplug-the-moon"], HOSTS, seed=1)
    with pytest.raises(ValueError, match="hosts"):
        plan([PARTITION_HOST], [], seed=1)


@pytest.mark.unit
def test_recovery_measures_the_gap_and_the_return_to_full_rate() -> None:
    # 100 acks/s until 10 s; the fault at 10, nothing until 16 s; healed at 12; a trickle
    # of 20/s until 20 s, then 100/s again
    acks = [i / 100 for i in range(1000)]
    acks += [16 + i / 20 for i in range(80)]
    acks += [20 + i / 100 for i in range(1000)]
    got = recovery(acks, Marks(PARTITION_HOST, ("h2",), began=10.0, healed=12.0))
    assert got.to_next_ack_s == pytest.approx(6.0)
    assert got.rate_before == pytest.approx(100.0)
    assert got.acks_during == 0
    assert got.to_full_rate_s is not None and 7.0 <= got.to_full_rate_s <= 8.1


@pytest.mark.unit
def test_recovery_without_acks_after_the_fault_says_so() -> None:
    got = recovery([1.0, 2.0, 3.0], Marks(HOST_CRASH, ("h3",), began=4.0, healed=5.0))
    assert got.to_next_ack_s is None and got.to_full_rate_s is None
