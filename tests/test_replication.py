"""Replication base: fencing and placement policy (pure), then replica groups on real Ray.

The multi-node class runs a 3-node `ray.cluster_utils.Cluster` on this machine and removes a
node for real; the single-node class runs a plain local Ray. Each class owns its Ray
instance (class-scoped fixture), so the two never overlap in this process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator

import pytest
import ray
from ray import cloudpickle
from ray.cluster_utils import Cluster

from runtime.engines.services import local_ray as start_local_ray
from runtime.state.replication import (
    SPREAD,
    STRICT_SPREAD,
    EpochFenced,
    Fence,
    FencedError,
    PlacementError,
    ReplicaGroup,
    ReplicaGroupError,
    ReplicaMixin,
    bundle_for,
    count_fitting_nodes,
    placement_plan,
)

# Workers cannot import this test module: ship the replica class by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NAMESPACE = "tierflow-test-replication"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# --------------------------------------------------------------------------- pure


@pytest.mark.unit
class TestPlacementPlan:
    def test_enough_nodes_is_strict_spread_without_warning(self) -> None:
        for nodes in (3, 4, 10):
            plan = placement_plan(nodes, 3)
            assert plan.strategy == STRICT_SPREAD
            assert plan.warning is None
            assert plan.tolerated_node_failures == 2

    def test_too_few_nodes_is_spread_with_warning_naming_k(self) -> None:
        plan = placement_plan(2, 4, role="logger")
        assert plan.strategy == SPREAD
        assert plan.k == 3
        assert plan.tolerated_node_failures == 1
        assert plan.warning is not None
        assert "k=3" in plan.warning
        assert "'logger'" in plan.warning
        assert "only 2 nodes are alive" in plan.warning
        assert "tolerates only 1 node failure(s), not 3" in plan.warning
        assert "Add 2 node(s) or lower k to 1" in plan.warning

    def test_single_node_warning_says_no_node_loss_tolerated(self) -> None:
        plan = placement_plan(1, 2)
        assert plan.strategy == SPREAD
        assert plan.tolerated_node_failures == 0
        assert "k=1" in plan.warning
        assert "cannot tolerate a node loss" in plan.warning

    def test_k0_needs_one_node(self) -> None:
        plan = placement_plan(1, 1)
        assert (plan.strategy, plan.warning) == (STRICT_SPREAD, None)

    @pytest.mark.parametrize(("nodes", "replicas"), [(0, 1), (1, 0), (3, -1)])
    def test_rejects_nonsense(self, nodes: int, replicas: int) -> None:
        with pytest.raises(ValueError):
            placement_plan(nodes, replicas)


@pytest.mark.unit
class TestBundles:
    def test_bundle_merges_custom_resources(self) -> None:
        assert bundle_for(0.01) == {"CPU": 0.01}
        assert bundle_for(0.5, {"logger_slot": 1}) == {"CPU": 0.5, "logger_slot": 1}
        assert bundle_for(0, {"disk": 1}) == {"disk": 1}

    def test_bundle_rejects_cpu_twice_and_empty(self) -> None:
        with pytest.raises(ValueError):
            bundle_for(0.1, {"CPU": 1})
        with pytest.raises(ValueError):
            bundle_for(0)

    def test_count_fitting_nodes_skips_dead_and_small_nodes(self) -> None:
        nodes = [
            {"Alive": True, "Resources": {"CPU": 1.0, "disk": 1.0}},
            {"Alive": True, "Resources": {"CPU": 1.0}},
            {"Alive": False, "Resources": {"CPU": 8.0, "disk": 1.0}},
            {"Alive": True, "Resources": {"CPU": 0.005, "disk": 1.0}},
        ]
        assert count_fitting_nodes(nodes, {"CPU": 0.01}) == 2
        assert count_fitting_nodes(nodes, {"CPU": 0.01, "disk": 1}) == 1


@pytest.mark.unit
class TestFence:
    def test_starts_at_zero_and_admits_current_and_newer(self) -> None:
        fence = Fence()
        assert (fence.epoch, fence.primary) == (0, None)
        assert fence.admit(0)
        fence.advance(2, primary=1)
        assert fence.admit(2)
        assert (fence.epoch, fence.primary) == (2, 1)

    def test_rejects_older_epoch(self) -> None:
        fence = Fence()
        fence.advance(3, primary=0)
        assert not fence.admit(2)
        with pytest.raises(EpochFenced) as info:
            fence.check(1)
        assert (info.value.current, info.value.offered) == (3, 1)
        assert "epoch 1 is older than accepted epoch 3" in str(info.value)
        assert fence.epoch == 3

    def test_newer_write_is_adopted_and_fences_the_older_writer(self) -> None:
        fence = Fence(1, primary=0)
        fence.check(2)  # a write from a primary this replica has not heard of yet
        assert (fence.epoch, fence.primary) == (2, None)
        assert not fence.admit(1)
        fence.advance(2, primary=1)  # the late announcement fills in the primary
        assert fence.primary == 1

    def test_advance_is_monotonic_and_idempotent(self) -> None:
        fence = Fence()
        fence.advance(1, primary=0)
        fence.advance(1, primary=0)  # repeated (retried) announcement
        assert (fence.epoch, fence.primary) == (1, 0)
        with pytest.raises(FencedError):
            fence.advance(0, primary=2)
        with pytest.raises(ValueError):
            fence.advance(1, primary=2)  # same epoch, different primary: a bug upstream
        assert (fence.epoch, fence.primary) == (1, 0)

    def test_bytes_round_trip(self) -> None:
        for fence in (Fence(), Fence(7, primary=2), Fence(5)):
            restored = Fence.from_bytes(fence.to_bytes())
            assert restored == fence
            assert (restored.epoch, restored.primary) == (fence.epoch, fence.primary)
        restored = Fence.from_bytes(Fence(7, primary=2).to_bytes())
        assert not restored.admit(6)

    @pytest.mark.parametrize(
        "data", [b"", b"garbage", b'{"epoch": -1}', b'{"epoch": 1, "extra": 2}', b"[1]"]
    )
    def test_from_bytes_rejects_corrupt_data(self, data: bytes) -> None:
        with pytest.raises(ValueError):
            Fence.from_bytes(data)

    def test_fenced_error_survives_pickling(self) -> None:
        error = cloudpickle.loads(cloudpickle.dumps(EpochFenced(4, 2)))
        assert (error.current, error.offered) == (4, 2)
        assert isinstance(error, FencedError)


# --------------------------------------------------------------------------- Ray


@ray.remote
class Register(ReplicaMixin):
    """A replica whose state is a list of values, written under the writer's epoch."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.values: list[str] = []

    def write(self, epoch: int, value: str) -> int:
        return self.fenced_write(epoch, lambda: self._append(value))

    def _append(self, value: str) -> int:
        self.values.append(value)
        return len(self.values)

    def read(self) -> list[str]:
        return list(self.values)


def write_all(group: ReplicaGroup, epoch: int, value: str) -> list[object]:
    """Each replica's answer to a write: its new length, or the exception it raised."""
    results: list[object] = []
    for handle in group.replicas:
        try:
            results.append(ray.get(handle.write.remote(epoch, value), timeout=30))
        except Exception as exc:
            results.append(exc)
    return results


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _fresh_driver() -> None:
    # Only one Ray connection per process: drop one another module may have left open.
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="class")
def cluster() -> Iterator[Cluster]:
    _fresh_driver()
    # No node_ip_address: ray.init(address=...) rewrites 127.0.0.1 to the machine's IP
    # (services.resolve_ip_for_localhost), so nodes bound to loopback are unreachable.
    node_args = {"num_cpus": 1}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "include_dashboard": False},
    )
    try:
        for _ in range(2):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="class")
def local_ray() -> Iterator[None]:
    _fresh_driver()
    start_local_ray(NAMESPACE, _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        ray.shutdown()


class TestThreeNodeCluster:
    def test_k2_spreads_fences_and_replaces_a_lost_replica(self, cluster: Cluster) -> None:
        group = ReplicaGroup("reg", 2, Register, ("t",), namespace=NAMESPACE, call_timeout=3)
        try:
            assert group.plan.strategy == STRICT_SPREAD
            assert group.warnings == []
            assert (group.epoch, group.primary) == (1, 0)

            # 3 replicas on 3 distinct live nodes
            nodes = group.nodes()
            assert None not in nodes
            assert len(set(nodes)) == 3
            assert set(nodes) == alive_node_ids()
            assert ray.get([r.replica_index.remote() for r in group.replicas]) == [0, 1, 2]
            assert ray.get([r.is_primary.remote() for r in group.replicas]) == [
                True,
                False,
                False,
            ]
            assert write_all(group, 1, "a") == [1, 1, 1]

            # promotion fences the old primary's epoch on every replica
            old_epoch = group.epoch
            new_epoch = group.promote(1)
            assert new_epoch == old_epoch + 1 == group.epoch
            assert group.primary == 1
            assert group.unacknowledged == []
            assert ray.get([r.epoch.remote() for r in group.replicas]) == [new_epoch] * 3
            assert ray.get([r.is_primary.remote() for r in group.replicas]) == [
                False,
                True,
                False,
            ]
            stale = write_all(group, old_epoch, "from-old-primary")
            for result in stale:
                assert isinstance(result, FencedError), result
                assert (result.current, result.offered) == (new_epoch, old_epoch)
            assert write_all(group, new_epoch, "b") == [2, 2, 2]
            assert ray.get([r.read.remote() for r in group.replicas]) == [["a", "b"]] * 3

            # lose a worker node that hosts a replica
            by_id = {node.node_id: node for node in cluster.worker_nodes}
            victim_index = next(i for i, n in enumerate(nodes) if n in by_id)
            victim_node_id = nodes[victim_index]
            cluster.remove_node(by_id[victim_node_id])
            assert wait_for(lambda: victim_node_id not in alive_node_ids(), timeout=60)

            # with the node gone, a promotion reaches only the live replicas
            epoch = group.promote(2)
            assert group.unacknowledged == [victim_index]
            live = [i for i in range(3) if i != victim_index]
            assert [ray.get(group.replicas[i].epoch.remote(), timeout=30) for i in live] == [
                epoch,
                epoch,
            ]
            # STRICT_SPREAD: the two survivors' nodes are taken, nowhere to re-place the bundle
            with pytest.raises(ReplicaGroupError, match="did not acknowledge"):
                group.replace(victim_index, timeout=3)

            # a node joins; the lost bundle is re-placed there and the replica replaced
            cluster.add_node(num_cpus=1)
            handle = group.replace(victim_index, timeout=60)
            assert group.replicas[victim_index] is handle
            assert group.unacknowledged == []
            new_node = ray.get(handle.node_id.remote(), timeout=30)
            assert new_node not in nodes  # only the new node can hold the bundle
            assert new_node in alive_node_ids()
            after = group.nodes()
            assert len(set(after)) == 3 and None not in after

            # the fresh replica starts empty but already fenced at the current epoch
            assert ray.get(handle.epoch.remote(), timeout=30) == group.epoch
            assert ray.get(handle.read.remote(), timeout=30) == []
            with pytest.raises(FencedError):
                ray.get(handle.write.remote(old_epoch, "late"), timeout=30)
            assert ray.get(handle.write.remote(group.epoch, "c"), timeout=30) == 1
        finally:
            group.shutdown()
        assert wait_for(lambda: not _name_taken("reg-0"), timeout=30)


def _name_taken(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


class TestSingleNode:
    def test_k1_starts_with_spread_and_warns(
        self, local_ray: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level("WARNING", logger="runtime.state.replication"):
            group = ReplicaGroup("solo", 1, Register, ("t",), namespace=NAMESPACE)
        try:
            assert group.plan.strategy == SPREAD
            assert len(group.warnings) == 1
            assert "k=1" in group.warnings[0]
            assert "cannot tolerate a node loss" in group.warnings[0]
            assert group.warnings[0] in caplog.text
            assert len(group.replicas) == 2
            nodes = group.nodes()
            assert nodes[0] is not None and nodes[0] == nodes[1]
            assert write_all(group, group.epoch, "x") == [1, 1]
        finally:
            group.shutdown()

    def test_unplaceable_group_fails_clearly(self, local_ray: None) -> None:
        with pytest.raises(PlacementError, match="could not place"):
            ReplicaGroup("huge", 1, Register, ("t",), cpu_per_replica=1.5, ready_timeout=2)
        with pytest.raises(PlacementError, match="no alive node"):
            ReplicaGroup("alien", 0, Register, ("t",), resources={"no-such-resource": 1})
