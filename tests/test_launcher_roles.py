"""The roles as data (cluster/deploy): what each role's pure builder declares, checked
without Ray; starting them is tested by test_scaling, test_multinode and test_cli."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.deploy.analysis import analysis_role, driver_options
from cluster.deploy.collection import bridge_role, collector_role
from cluster.deploy.gateway import gateway_role
from cluster.deploy.logger import logger_role
from cluster.deploy.spec import RoleSpec, Start, SupervisorSpec, on_node
from cluster.deploy.stream_ingest import ingest_role
from cluster.launcher import root_role
from runtime.config import Config, load
from runtime.roles import NATS_ROLES, SCALABLE_ROLES
from runtime.state.placement import NODE_HINT
from runtime.supervision.policy import ChildSpec, Intensity, Strategy

pytestmark = pytest.mark.unit


@pytest.fixture
def cfg(tmp_path: Path) -> Config:
    return load(
        environ={},
        overrides={
            "state_dir": str(tmp_path),
            "roles": {
                "logger": {"replicas": 2, "k": 2},
                "bridge": {"replicas": 2},
                "collector": {"replicas": 3},
                "gateway": {"replicas": 2},
            },
        },
    )


def test_each_role_is_declared_with_its_supervisor_start_and_readiness(cfg: Config) -> None:
    loggers = logger_role(cfg)
    assert (loggers.names, loggers.start, loggers.k) == (
        ["logger-0", "logger-1"],
        Start.REPLICA_GROUPS,
        2,
    )
    assert loggers.children[1].kwargs["replicas"] == 3 and loggers.supervisor is None
    assert logger_role(cfg, groups=[4]).names == ["logger-4"]

    clients = ["group-client-0", "group-client-1"]  # LoggerGroup clients, opaque here
    bridges = bridge_role(cfg, nats_url="nats://n", loggers=clients)
    assert bridges.names == ["bridge-0", "bridge-1"] and bridges.ready == "ready"
    assert [c.kwargs["replay"] for c in bridges.children] == [True, False]
    collectors = collector_role(
        cfg,
        nats_url="nats://n",
        loggers=clients,
        bridges=bridges.names,
        port=8123,
        udp_port=0,
        namespace="ns",
    )
    assert collectors.names == ["collector-0", "collector-1", "collector-2"]
    assert [c.kwargs["logger"] for c in collectors.children] == [*clients, clients[0]]
    assert {c.kwargs["port"] for c in collectors.children} == {8123}
    assert collectors.ready == "endpoints"
    # bridges and collectors share the one `collection` supervisor: one for one, 20 a minute
    assert bridges.supervisor == collectors.supervisor == SupervisorSpec("collection")
    assert collectors.supervisor.strategy is Strategy.ONE_FOR_ONE
    assert collectors.supervisor.intensity == Intensity(max_restarts=20, period_s=60.0)

    gateways = gateway_role(cfg, "nats://n", 8080)
    assert gateways.names == ["gateway-0", "gateway-1"]
    assert gateways.supervisor == SupervisorSpec("gateways") and gateways.ready == "endpoints"
    assert gateways.children[0].start == "actors.access.gateway:Gateway"

    ingest = ingest_role("meetup", "ws://src", "ws", replicas=2, nats_url="n", state_dir="s")
    assert ingest.names == ["ingest-meetup-0", "ingest-meetup-1"]
    assert ingest.start is Start.DETACHED and ingest.ready is None
    assert ingest.children[0].args == ("meetup", "ws://src", "ws")
    assert ingest.children[0].ray_options == {"num_cpus": 0, "scheduling_strategy": "SPREAD"}

    driver = analysis_role(cfg, "nats://n")
    assert driver.names == ["tierflow-analysis"] and driver.start is Start.DETACHED
    # the role's Ray options are exactly what a driver started by hand gets
    (child,) = driver.children
    assert dict(child.ray_options or {}).items() <= driver_options(cfg).items()

    root = root_role()
    assert root.children == () and root.supervisor is not None
    assert (root.supervisor.name, root.supervisor.intensity.max_restarts) == ("tierflow-root", 5)


def test_role_specs_refuse_what_could_not_run() -> None:
    child = ChildSpec("x-0", "m:C")
    with pytest.raises(ValueError, match="duplicate child id"):
        RoleSpec("x", (child, child), Start.DETACHED)
    with pytest.raises(ValueError, match="supervisor goes with"):
        RoleSpec("x", (child,), Start.SUPERVISED)
    with pytest.raises(ValueError, match="supervisor goes with"):
        RoleSpec("x", (child,), Start.DETACHED, supervisor=SupervisorSpec("s"))
    with pytest.raises(ValueError, match="k must be"):
        RoleSpec("x", (child,), Start.REPLICA_GROUPS, k=-1)


def test_placement_is_a_hint_in_the_child_spec() -> None:
    child = ChildSpec("x-0", "m:C", ray_options={"num_cpus": 0})
    assert on_node(child, None) is child
    assert on_node(child, "node-a").ray_options == {"num_cpus": 0, NODE_HINT: "node-a"}


def test_one_shape_for_the_two_sets_of_roles() -> None:
    assert SCALABLE_ROLES == ("collector", "logger", "bridge", "gateway")
    assert set(NATS_ROLES) >= {"admin", "collector", "bridge", "gateway", "ingest", "analysis"}
    assert "logger" not in NATS_ROLES  # the logger never reaches NATS
