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

    nats_url: str = ""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def spec(self, role: str, i: int) -> ChildSpec:
        """The child spec of replica `i` of a role (the whole configuration: Ray reruns
        `__init__` with exactly these arguments on restart)."""
        common = {
            "state_dir": str(self.cfg.state_path),
            "config": self.cfg.to_dict(),
            "nats_url": self.nats_url,
            **self.options.get(role, {}),
        }
        if role == "bridge":
            kwargs = {"name": f"bridge-{i}", "loggers": self.loggers, "replay": i == 0}
            start = "actors.bridge:BrokerBridge"
        elif role == "collector":
            kwargs = {
                "name": f"collector-{i}",
                "logger": self.loggers[i % len(self.loggers)],
                "bridges": self.bridges,
                "port": self.collector_port,
                "udp_port": self.udp_port,
                "namespace": self.namespace,
            }
            start = "actors.collector:Collector"
        else:
            raise ValueError(f"no spec for role {role!r}")
        return ChildSpec(
            id=kwargs["name"],
            start=start,
            kwargs={**common, **kwargs},
            ray_options={"num_cpus": 0},
        )

    def wait_serving(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        import ray

        from runtime.waiting import wait_until

        return wait_until(
            lambda: ray.get(self.actor(name).endpoints.remote(), timeout=30),
            timeout=timeout,
            what=f"{name} serving",
            swallow=True,
        )

    def scale(self, role: str, n: int) -> list[str]:
        """Grow or shrink a role to `n` replicas while data flows.

        Scale-down drains: the replica stops taking work (its listening socket closes, so
        SO_REUSEPORT sends new connections to the others), finishes what is in hand, hands
        its logged batches on, then leaves. What it accepted is in the MessageLogger, so
        nothing acknowledged is lost; a client whose connection closes retries. Only
        collectors scale this way for now: loggers hold state (k+1 groups), and bridges
        are named by collectors at construction.
        """
        import ray

        if role != "collector":
            raise ValueError(f"scaling {role!r} is not supported yet (collectors only)")
        if n < 1:
            raise ValueError("a role needs at least 1 replica")
        names = self.collectors
        while len(names) < n:
            i = _next_index(names, "collector")
            spec = self.spec(role, i)
            ray.get(self.supervisor.add_child.remote(spec), timeout=60)
            self.wait_serving(spec.id)
            names.append(spec.id)
        while len(names) > n:
            name = names.pop()
            ray.get(self.supervisor.remove_child.remote(name, drain="shutdown"), timeout=120)
        return list(names)

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


def _next_index(names: list[str], role: str) -> int:
    used = {int(n.rsplit("-", 1)[1]) for n in names}
    return next(i for i in range(len(used) + 1) if i not in used)


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

    tier.nats_url, tier.udp_port = nats_url, udp_port
    tier.options = {
        "bridge": dict(bridge_options or {}),
        "collector": dict(collector_options or {}),
    }
    port = cfg.roles.collector.port if collector_port is None else collector_port
    if not port:
        from runtime.nats import free_port

        port = free_port()  # replicas share it with SO_REUSEPORT, so it is fixed up front
    tier.collector_port = port
    tier.bridges = [f"bridge-{i}" for i in range(cfg.roles.bridge.replicas)]
    tier.collectors = [f"collector-{i}" for i in range(cfg.roles.collector.replicas)]
    specs = [tier.spec("bridge", i) for i in range(len(tier.bridges))]
    specs += [tier.spec("collector", i) for i in range(len(tier.collectors))]
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
        tier.udp_port = tier.wait_serving(name)["udp_port"]
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
