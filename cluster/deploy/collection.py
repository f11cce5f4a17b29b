"""The bridge and collector roles: children of the ``collection`` supervisor, as
`RoleSpec`s built from the config and what they are wired to (pure functions).

Every actor gets its whole configuration at construction, because Ray reruns `__init__`
with the same arguments on restart: nothing set later survives a crash. So a collector
names its logger group and the bridges, and a bridge the logger groups it completes.
`cluster.pipeline.CollectionTier` starts and resizes them with these builders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.deploy.spec import RoleSpec, Start, SupervisorSpec, replica_name
from runtime.config import Config
from runtime.supervision.policy import ChildSpec

SUPERVISOR = "collection"
COLLECTION = SupervisorSpec(SUPERVISOR)  # one for one, 20 restarts a minute
BRIDGE = "actors.queue.bridge:BrokerBridge"
COLLECTOR = "actors.collection.collector:Collector"
BRIDGE_READY = "ready"  # the logger groups it completes, once constructed
COLLECTOR_READY = "endpoints"  # where it serves (its UDP port among them)


def _common(cfg: Config, nats_url: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "state_dir": str(cfg.state_path),
        "config": cfg.to_dict(),
        "nats_url": nats_url,
        **(options or {}),
    }


def bridge_child(
    cfg: Config,
    i: int,
    *,
    nats_url: str,
    loggers: Sequence[Any],
    replay: bool,
    options: Mapping[str, Any] | None = None,
) -> ChildSpec:
    """Bridge `i`: publishes what `loggers` (LoggerGroup clients) hold; the one that
    `replay`s also resends what the groups still held at its start."""
    name = replica_name("bridge", i)
    kwargs = {"name": name, "loggers": list(loggers), "replay": replay}
    return ChildSpec(
        id=name,
        start=BRIDGE,
        kwargs={**_common(cfg, nats_url, options), **kwargs},
        ray_options={"num_cpus": 0},
    )


def collector_child(
    cfg: Config,
    i: int,
    *,
    nats_url: str,
    loggers: Sequence[Any],
    bridges: Sequence[str],
    port: int,
    udp_port: int,
    namespace: str,
    options: Mapping[str, Any] | None = None,
) -> ChildSpec:
    """Collector `i`: logs to group ``i mod len(loggers)``, hands batches to `bridges`,
    serves `port` (shared with SO_REUSEPORT) and `udp_port`."""
    name = replica_name("collector", i)
    kwargs = {
        "name": name,
        "logger": loggers[i % len(loggers)],
        "bridges": list(bridges),
        "port": port,
        "udp_port": udp_port,
        "namespace": namespace,
    }
    return ChildSpec(
        id=name,
        start=COLLECTOR,
        kwargs={**_common(cfg, nats_url, options), **kwargs},
        ray_options={"num_cpus": 0},
    )


def bridge_role(
    cfg: Config,
    *,
    nats_url: str,
    loggers: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    replicas: int | None = None,
) -> RoleSpec:
    """`roles.bridge.replicas` bridges; the first replays."""
    n = cfg.roles.bridge.replicas if replicas is None else replicas
    children = [
        bridge_child(cfg, i, nats_url=nats_url, loggers=loggers, replay=i == 0, options=options)
        for i in range(n)
    ]
    return RoleSpec(
        role="bridge",
        children=tuple(children),
        start=Start.SUPERVISED,
        supervisor=COLLECTION,
        ready=BRIDGE_READY,
    )


def collector_role(
    cfg: Config,
    *,
    nats_url: str,
    loggers: Sequence[Any],
    bridges: Sequence[str],
    port: int,
    udp_port: int,
    namespace: str,
    options: Mapping[str, Any] | None = None,
    replicas: int | None = None,
) -> RoleSpec:
    """`roles.collector.replicas` collectors sharing `port`."""
    n = cfg.roles.collector.replicas if replicas is None else replicas
    children = [
        collector_child(
            cfg,
            i,
            nats_url=nats_url,
            loggers=loggers,
            bridges=bridges,
            port=port,
            udp_port=udp_port,
            namespace=namespace,
            options=options,
        )
        for i in range(n)
    ]
    return RoleSpec(
        role="collector",
        children=tuple(children),
        start=Start.SUPERVISED,
        supervisor=COLLECTION,
        ready=COLLECTOR_READY,
    )
