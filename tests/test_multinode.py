"""The collection and access tiers on a 3-node Ray cluster (`ray.cluster_utils.Cluster`,
three raylets on one machine): each role's replicas on distinct nodes, and a node removed
under load at k=1 costs nothing acknowledged.

Real raylets, a real nats-server and LevelDB. With three nodes and k=1 each logger group
keeps three replicas (`logging.extra_replicas` "auto"). Removing a node kills every process
on it (a collector, a bridge, a gateway and a logger replica among them); Ray restarts the
actors it can elsewhere, and the logger group goes on with the two replicas left as its
in-sync set: k+1 caught-up copies on distinct live nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from actors.queue.logger.in_sync import members, newest
from cluster.pipeline import CollectionTier, start_collection_tier
from runtime.config import load
from runtime.nats.server import NatsServer
from runtime.waiting import wait_until
from tests.support import NatsFactory, assert_all_landed, under_load

pytestmark = pytest.mark.slow
NAMESPACE = "tf-multinode"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():  # one Ray connection per process
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.add_node(num_cpus=1, resources={"analysis": 1})  # where the Spark driver goes
        c.wait_for_nodes()
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def pipeline(
    cluster: Cluster, nats_factory: NatsFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[CollectionTier, NatsServer, list[str]]]:
    from cluster.deploy.gateway import start_gateways, stop_gateways

    with nats_factory() as server:
        cfg = load(
            environ={},
            overrides={
                "state_dir": str(tmp_path_factory.mktemp("state")),
                "ray": {"namespace": NAMESPACE},
                "roles": {
                    "logger": {"k": 1},
                    "collector": {"replicas": 3, "port": 0},
                    "bridge": {"replicas": 2},
                },
                "streams": {"meetup": {"subjects": ["raw.meetup"]}},
            },
        )
        tier = start_collection_tier(cfg, nats_url=server.url)
        gateways = start_gateways(cfg, server.url, 2, 0)
        try:
            yield tier, server, gateways
        finally:
            stop_gateways(cfg, gateways)
            tier.stop()


def gateway_nodes(names: list[str]) -> dict[str, str | None]:
    from runtime.state.placement import actor_nodes

    return actor_nodes({n: ray.get_actor(n, namespace=NAMESPACE) for n in names})


def test_each_roles_replicas_land_on_distinct_nodes(pipeline: Any) -> None:
    tier, _, gateways = pipeline
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(alive) == 3
    placed = {**tier.placement(), "gateway": gateway_nodes(gateways)}
    for role, where in placed.items():
        nodes = list(where.values())
        assert None not in nodes, (role, where)
        assert set(nodes) <= alive
        assert len(set(nodes)) == len(nodes), f"{role} replicas share a node: {where}"
    assert len(placed["collector"]) == 3 and len(placed["logger"]) == 3  # k+1, one extra


def test_the_analysis_driver_goes_where_configured(cluster: Cluster) -> None:
    """`spark.driver_resource` names a node resource; the driver's Ray options put it
    there (checked with a light stand-in actor under the same options, not Spark)."""
    from cluster.deploy.analysis import driver_options

    cfg = load(environ={}, overrides={"ray": {"namespace": NAMESPACE}})
    assert "resources" not in driver_options(cfg)
    cfg = load(
        environ={},
        overrides={"ray": {"namespace": NAMESPACE}, "spark": {"driver_resource": "analysis"}},
    )

    @ray.remote
    class StandIn:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    target = next(n["NodeID"] for n in ray.nodes() if "analysis" in n["Resources"])
    handles = [
        StandIn.options(**driver_options(cfg, name=f"stand-in-{i}")).remote() for i in range(3)
    ]
    try:
        assert {ray.get(h.node.remote(), timeout=60) for h in handles} == {target}
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)


async def test_removing_a_node_under_load_loses_nothing_acknowledged_at_k1(
    cluster: Cluster, pipeline: Any, tmp_path: Path
) -> None:
    tier, server, _ = pipeline
    tier: CollectionTier
    loop = asyncio.get_running_loop()
    placed = await loop.run_in_executor(None, tier.placement)
    # the worker node holding a logger replica (the head cannot be removed)
    logger_nodes = set(placed["logger"].values())
    victim = next(n for n in cluster.worker_nodes if n.node_id in logger_nodes)
    doomed = {r: [a for a, node in w.items() if node == victim.node_id] for r, w in placed.items()}
    assert doomed["logger"] and doomed["collector"], doomed

    async def lose_the_node() -> None:
        await loop.run_in_executor(None, cluster.remove_node, victim)

    # the load keeps being accepted: the collectors left serve, the logger group is back
    report = await under_load(tier, "node", lose_the_node, 600, after=20, after_timeout_s=240)

    def k_plus_one_again() -> bool:  # the set left: k+1 caught-up copies on live nodes
        statuses = []
        for handle in tier.logger_groups[0].replicas:
            try:
                statuses.append(ray.get(handle.status.remote(), timeout=10))
            except Exception:  # noqa: BLE001 - the lost one: it does not answer
                statuses.append({"error": "no answer"})
        config = newest(statuses, len(statuses))
        if config is None:
            return False
        inside = [statuses[i] for i in members(config, len(statuses))]
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        nodes = {st.get("node_id") for st in inside}
        caught_up = all(not st.get("error") and not st.get("catching_up") for st in inside)
        return caught_up and len(inside) >= 2 and len(nodes) == len(inside) and nodes <= alive

    await loop.run_in_executor(
        None, lambda: wait_until(k_plus_one_again, 180, 1.0, "logger back at k+1", swallow=True)
    )

    await assert_all_landed(tier, server, report)
    # every collector is serving again (Ray restarted the lost one on a live node)
    for name in tier.collectors:
        await loop.run_in_executor(None, tier.wait_serving, name, 180)
