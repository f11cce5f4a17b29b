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
from runtime.placement import affinity, next_index
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
        """The collectors' base URL as clients reach it (https when `[tls]` is on)."""
        from runtime.tls import http_scheme

        return f"{http_scheme(self.cfg)}://127.0.0.1:{self.collector_port}"

    nats_url: str = ""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def spec(
        self, role: str, i: int, node: str | None = None, *, replay: bool | None = None
    ) -> ChildSpec:
        """The child spec of replica `i` of a role (the whole configuration: Ray reruns
        `__init__` with exactly these arguments on restart), softly pinned to `node`."""
        common = {
            "state_dir": str(self.cfg.state_path),
            "config": self.cfg.to_dict(),
            "nats_url": self.nats_url,
            **self.options.get(role, {}),
        }
        if role == "bridge":
            kwargs = {
                "name": f"bridge-{i}",
                "loggers": self.loggers,
                "replay": i == 0 if replay is None else replay,
            }
            start = "actors.queue.bridge:BrokerBridge"
        elif role == "collector":
            kwargs = {
                "name": f"collector-{i}",
                "logger": self.loggers[i % len(self.loggers)],
                "bridges": self.bridges,
                "port": self.collector_port,
                "udp_port": self.udp_port,
                "namespace": self.namespace,
            }
            start = "actors.collection.collector:Collector"
        else:
            raise ValueError(f"no spec for role {role!r}")
        return ChildSpec(
            id=kwargs["name"],
            start=start,
            kwargs={**common, **kwargs},
            ray_options={"num_cpus": 0, **affinity(node)},
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
        """Grow or shrink a role to `n` replicas while data flows; returns its replicas.

        Scale-down drains: a collector stops taking work (its listening socket closes, so
        SO_REUSEPORT sends new connections to the others), finishes what is in hand, hands
        its logged batches on, then leaves; a client whose connection closes retries. A
        logger group leaves only once bridges have put everything it holds into JetStream.
        Collectors name their logger and bridges at construction (Ray reruns `__init__`
        with the same arguments), so resizing loggers or bridges rolls the collectors:
        a new one starts and serves before an old one drains.
        """
        if n < 1:
            raise ValueError("a role needs at least 1 replica")
        if role == "collector":
            self._scale_collectors(n)
            return list(self.collectors)
        if role == "bridge":
            self._scale_bridges(n)
            return list(self.bridges)
        if role == "logger":
            self._scale_loggers(n)
            return [g.name for g in self.loggers]
        raise ValueError(f"role {role!r} does not scale here (collector, bridge, logger)")

    def _add(self, role: str, names: list[str], replay: bool | None = None) -> str:
        import ray

        from runtime.placement import actor_nodes, alive_nodes, plan

        placed = actor_nodes({name: self.actor(name) for name in names})
        i = next_index(names, role)
        spec = self.spec(role, i, plan(1, alive_nodes(), placed.values())[0], replay=replay)
        ray.get(self.supervisor.add_child.remote(spec), timeout=60)
        if role == "collector":
            self.wait_serving(spec.id)
        else:
            self.wait_bridge(spec.id)
        names.append(spec.id)
        return spec.id

    def _remove(self, name: str) -> bool:
        import ray

        return ray.get(self.supervisor.remove_child.remote(name, drain="shutdown"), timeout=180)

    def _scale_collectors(self, n: int) -> None:
        while len(self.collectors) < n:
            self._add("collector", self.collectors)
        while len(self.collectors) > n:
            self._remove(self.collectors.pop())

    def _roll_collectors(self) -> None:
        """Replace every collector by one built from the current loggers and bridges."""
        old = list(self.collectors)
        for name in old:
            self._add("collector", self.collectors)
            self.collectors.remove(name)
            self._remove(name)

    def _roll_bridges(self) -> None:
        """New bridges (the first replays), collectors moved to them, old bridges drained."""
        old = list(self.bridges)
        fresh: list[str] = []
        for j in range(len(old)):
            fresh.append(self._add("bridge", [*old, *fresh], replay=j == 0))
        self.bridges = fresh
        self._roll_collectors()
        for name in old:
            self._remove(name)

    def _scale_bridges(self, n: int) -> None:
        if n > len(self.bridges):
            while len(self.bridges) < n:
                self._add("bridge", self.bridges, replay=False)
            self._roll_collectors()
        elif n < len(self.bridges):
            leaving = self.bridges[n:]
            self.bridges = self.bridges[:n]
            self._roll_collectors()  # no collector names a leaving bridge any more
            for name in leaving:
                self._remove(name)

    def _scale_loggers(self, n: int) -> None:
        from cluster.deploy.logger import start_logger_group

        if n > len(self.loggers):
            while len(self.loggers) < n:
                i = next_index([g.name for g in self.loggers], "logger")
                group, client = start_logger_group(
                    f"logger-{i}",
                    k=self.cfg.roles.logger.k,
                    state_dir=str(self.cfg.state_path),
                    namespace=self.namespace,
                    max_events=self.cfg.logging.max_pending_events,
                    max_bytes=self.cfg.logging.max_pending_bytes,
                )
                self.logger_groups.append(group)
                self.loggers.append(client)
            self._roll_bridges()  # bridges must know a group before collectors write to it
        elif n < len(self.loggers):
            leaving = self.loggers[n:]
            leaving_groups = self.logger_groups[n:]
            self.loggers, self.logger_groups = self.loggers[:n], self.logger_groups[:n]
            self._roll_collectors()  # nothing new is written to the leaving groups
            for client in leaving:
                _wait_logger_empty(client)  # the bridges still replay what they hold
            self._roll_bridges()
            for group in leaving_groups:
                group.shutdown()

    def wait_bridge(self, name: str, timeout: float = 120.0) -> None:
        import ray

        from runtime.waiting import wait_until

        wait_until(
            lambda: ray.get(self.actor(name).ready.remote(), timeout=30) is not None,
            timeout=timeout,
            what=f"{name} ready",
            swallow=True,
        )

    def placement(self) -> dict[str, dict[str, str | None]]:
        """role -> {replica: node id} as the replicas report it now."""
        from runtime.placement import actor_nodes

        loggers: dict[str, str | None] = {}
        for group in self.logger_groups:
            try:
                nodes = group.nodes(timeout=10)
            except Exception:  # a replica restarting: it holds no place for now
                nodes = [None] * (self.cfg.roles.logger.k + 1)
            loggers.update({f"{group.role}/{i}": n for i, n in enumerate(nodes)})
        return {
            "collector": actor_nodes({n: self.actor(n) for n in self.collectors}),
            "bridge": actor_nodes({n: self.actor(n) for n in self.bridges}),
            "logger": loggers,
        }

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


def _wait_logger_empty(client: Any, timeout_s: float = 300.0) -> None:
    """Block until a logger group holds nothing JetStream lacks (what it held is handed
    over); raise, keeping the group, if that does not happen in time."""
    import asyncio

    from runtime.waiting import wait_until

    def empty() -> bool:  # every replica: one that missed forgets is not drained yet
        return asyncio.run(client.drained())

    wait_until(empty, timeout=timeout_s, interval=0.5, what=f"{client.name} drained", swallow=True)


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
    from cluster.deploy.logger import start_logger_group
    from runtime.placement import alive_nodes, plan
    from runtime.ray_supervisor import start_supervisor

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
    nodes = alive_nodes()
    specs = [tier.spec("bridge", i, node) for i, node in enumerate(plan(len(tier.bridges), nodes))]
    specs += [
        tier.spec("collector", i, node) for i, node in enumerate(plan(len(tier.collectors), nodes))
    ]
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
        tier.wait_bridge(name)
    for name in tier.collectors:
        tier.udp_port = tier.wait_serving(name)["udp_port"]
    for stream, sc in cfg.streams.items():
        if sc.source.url:
            from cluster.deploy.stream_ingest import start_stream_ingest

            start_stream_ingest(
                stream,
                sc.source.url,
                sc.source.kind,
                replicas=sc.source.k + 1,
                nats_url=nats_url,
                state_dir=state,
                namespace=ns,
                config=cfg.to_dict(),
            )
            tier.ingest += [f"ingest-{stream}-{i}" for i in range(sc.source.k + 1)]
    return tier
