"""Start the collection tier's roles on Ray: loggers, bridges and collectors.

Loggers are replica groups (k+1 copies on distinct nodes where possible, restarted by
Ray, fenced by epoch). Bridges and collectors are children of the `collection` role
supervisor, which adds restart intensity, heartbeats and escalation to Ray's restarts.
Every actor gets its whole configuration at construction, because Ray reruns
`__init__` with the same arguments on restart: nothing set later survives a crash.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from runtime.config import Config
from runtime.supervision import ChildSpec, Intensity, Strategy

log = logging.getLogger(__name__)

SUPERVISOR = "collection"


@dataclass
class CollectionTier:
    """Handles to one running collection tier."""

    cfg: Config
    namespace: str
    loggers: list[Any] = field(default_factory=list)  # LoggerGroup clients
    logger_groups: list[Any] = field(default_factory=list)  # ReplicaGroups
    bridges: list[str] = field(default_factory=list)
    collectors: list[str] = field(default_factory=list)
    supervisor: Any = None
    collector_port: int = 0
    udp_port: int = 0
    ingest: list[str] = field(default_factory=list)  # stream-pattern ingest nodes

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.collector_port}"

    def actor(self, name: str) -> Any:
        import ray

        return ray.get_actor(name, namespace=self.namespace)

    def stop(self) -> None:
        """Stop collectors first (they drain), then bridges, then the logger groups."""
        import ray

        for name in self.ingest:  # the source first: nothing new enters while draining
            try:
                handle = self.actor(name)
                ray.get(handle.stop.remote(), timeout=30)
                ray.kill(handle, no_restart=True)
            except Exception as err:
                log.info("ingest %s: %r", name, err)
        for name in self.collectors:
            try:
                ray.get(self.actor(name).shutdown.remote(), timeout=60)
            except Exception as err:  # already gone: nothing left to drain
                log.info("collector %s: %r", name, err)
        if self.supervisor is not None:
            try:
                ray.get(self.supervisor.stop.remote(), timeout=60)
            except Exception as err:
                log.warning("collection supervisor stop: %r", err)
            ray.kill(self.supervisor, no_restart=True)
            self.supervisor = None
        for group in self.logger_groups:
            group.shutdown()
        self.logger_groups.clear()


def start_collection_tier(
    cfg: Config,
    *,
    nats_url: str,
    collector_port: int | None = None,
    udp_port: int = 0,
    bridge_options: dict[str, Any] | None = None,
    collector_options: dict[str, Any] | None = None,
) -> CollectionTier:
    """Start loggers, bridges and collectors; returns once every collector serves."""
    import ray

    from actors.logger import start_logger_group
    from runtime.ray_supervisor import start_supervisor
    from runtime.waiting import wait_until

    ns = cfg.ray.namespace
    state = str(cfg.state_path)
    tier = CollectionTier(cfg=cfg, namespace=ns)
    for i in range(cfg.roles.logger.replicas):
        group, client = start_logger_group(
            f"logger-{i}",
            k=cfg.roles.logger.k,
            state_dir=state,
            namespace=ns,
            max_events=cfg.logging.max_pending_events,
            max_bytes=cfg.logging.max_pending_bytes,
        )
        tier.logger_groups.append(group)
        tier.loggers.append(client)

    config = cfg.to_dict()
    specs: list[ChildSpec] = []
    for i in range(cfg.roles.bridge.replicas):
        name = f"bridge-{i}"
        tier.bridges.append(name)
        specs.append(
            ChildSpec(
                id=name,
                start="actors.bridge:BrokerBridge",
                kwargs={
                    "state_dir": state,
                    "name": name,
                    "config": config,
                    "nats_url": nats_url,
                    "loggers": tier.loggers,
                    "replay": i == 0,
                    **(bridge_options or {}),
                },
                ray_options={"num_cpus": 0},
            )
        )
    port = cfg.roles.collector.port if collector_port is None else collector_port
    if not port:
        from runtime.nats import free_port

        port = free_port()  # replicas share it with SO_REUSEPORT, so it is fixed up front
    tier.collector_port = port
    for i in range(cfg.roles.collector.replicas):
        name = f"collector-{i}"
        tier.collectors.append(name)
        specs.append(
            ChildSpec(
                id=name,
                start="actors.collector:Collector",
                kwargs={
                    "state_dir": state,
                    "name": name,
                    "config": config,
                    "logger": tier.loggers[i % len(tier.loggers)],
                    "bridges": tier.bridges,
                    "nats_url": nats_url,
                    "port": port,
                    "udp_port": udp_port,
                    "namespace": ns,
                    **(collector_options or {}),
                },
                ray_options={"num_cpus": 0},
            )
        )
    tier.supervisor = start_supervisor(
        SUPERVISOR,
        specs,
        state_dir=state,
        namespace=ns,
        ray_options={"num_cpus": 0},
        strategy=Strategy.ONE_FOR_ONE,
        intensity=Intensity(max_restarts=20, period_s=60.0),
    )
    for name in tier.bridges:  # a bridge is ready once its streams exist
        wait_until(
            lambda n=name: ray.get(tier.actor(n).ready.remote(), timeout=30) is not None,
            timeout=120,
            what=f"{name} ready",
            swallow=True,
        )
    for name in tier.collectors:
        ep = wait_until(
            lambda n=name: ray.get(tier.actor(n).endpoints.remote(), timeout=30),
            timeout=120,
            what=f"{name} serving",
            swallow=True,
        )
        tier.udp_port = ep["udp_port"]
    for stream, sc in cfg.streams.items():
        if sc.source.url:
            from actors.stream_ingest import start_stream_ingest

            start_stream_ingest(
                stream,
                sc.source.url,
                sc.source.kind,
                replicas=sc.source.k + 1,
                nats_url=nats_url,
                state_dir=state,
                namespace=ns,
            )
            tier.ingest += [f"ingest-{stream}-{i}" for i in range(sc.source.k + 1)]
    return tier
