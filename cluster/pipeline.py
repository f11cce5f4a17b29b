"""The collection tier on Ray: loggers, bridges and collectors, started and resized as one.

Loggers are replica groups (k+1 copies on distinct nodes where possible, restarted by
Ray, fenced by epoch). Bridges and collectors are children of the `collection` role
supervisor, which adds restart intensity, heartbeats and escalation to Ray's restarts.
Their specs come from `cluster.deploy.logger` and `cluster.deploy.collection`; they are
started, resized and stopped through `cluster.deploy.deployer`. What this module adds is
the order between them: a collector names its logger group and the bridges at
construction (Ray reruns `__init__` with the same arguments), so resizing loggers or
bridges rolls the collectors.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.deploy.collection import (
    BRIDGE_READY,
    COLLECTOR_READY,
    SUPERVISOR,
    bridge_child,
    bridge_role,
    collector_child,
    collector_role,
)
from cluster.deploy.deployer import (
    add_replica,
    deploy,
    deploy_on_port,
    drain,
    remove_replica,
    stop_supervisor,
    wait_ready,
)
from cluster.deploy.logger import logger_role
from cluster.deploy.spec import RoleSpec
from cluster.deploy.stream_ingest import ingest_role
from runtime.binding import PortTakenError, url_host
from runtime.config import Config
from runtime.nats.server import PortChooser
from runtime.state.placement import actor_nodes, next_index
from runtime.supervision.policy import ChildSpec
from runtime.tls import http_scheme
from runtime.waiting import wait_until

log = logging.getLogger(__name__)

__all__ = ["SUPERVISOR", "CollectionTier", "start_collection_tier"]


LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


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
    nats_url: str = ""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # role -> extra kwargs

    @property
    def url(self) -> str:
        """The collectors' base URL as clients reach it (https when `[tls]` is on): loopback,
        or with `roles.collector.host` set, the first collector's advertised address."""
        host = self.cfg.roles.collector.host
        if host in LOOPBACK:
            return f"{http_scheme(self.cfg)}://{url_host(host)}:{self.collector_port}"
        return self.urls()[0]

    def urls(self, timeout_s: float = 30.0) -> list[str]:
        """Every distinct address the collectors serve at (one per host they run on): a
        producer's list to move along when one stops answering."""
        import ray

        found: list[str] = []
        for name in self.collectors:
            handle = ray.get_actor(name, namespace=self.cfg.ray.namespace)
            url = str(ray.get(handle.endpoints.remote(), timeout=timeout_s)["url"])
            if url not in found:
                found.append(url)
        return found

    def child(self, role: str, i: int, *, replay: bool | None = None) -> ChildSpec:
        """The child spec of replica `i` of a role, wired to the tier as it is now (the
        whole configuration: Ray reruns `__init__` with exactly these arguments)."""
        if role == "bridge":
            return bridge_child(
                self.cfg,
                i,
                nats_url=self.nats_url,
                loggers=self.loggers,
                replay=i == 0 if replay is None else replay,
                options=self.options.get(role),
            )
        if role == "collector":
            return collector_child(
                self.cfg,
                i,
                nats_url=self.nats_url,
                loggers=self.loggers,
                bridges=self.bridges,
                port=self.collector_port,
                udp_port=self.udp_port,
                namespace=self.namespace,
                options=self.options.get(role),
            )
        raise ValueError(f"no spec for role {role!r}")

    def wait_serving(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        return wait_ready(self.namespace, name, COLLECTOR_READY, timeout)

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
        """One more replica of `role` on the node with the fewest of `names`, serving."""
        spec = self.child(role, next_index(names, role), replay=replay)
        ready = COLLECTOR_READY if role == "collector" else BRIDGE_READY
        add_replica(self.supervisor, spec, namespace=self.namespace, siblings=names, ready=ready)
        names.append(spec.id)
        return spec.id

    def _remove(self, name: str) -> bool:
        return remove_replica(self.supervisor, name, timeout_s=180)

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
        if n > len(self.loggers):
            while len(self.loggers) < n:
                i = next_index([g.name for g in self.loggers], "logger")
                (added,) = deploy(
                    [logger_role(self.cfg, groups=[i])],
                    namespace=self.namespace,
                    state_dir=str(self.cfg.state_path),
                )
                group, client = added.groups[0]
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
        wait_ready(self.namespace, name, BRIDGE_READY, timeout)

    def placement(self) -> dict[str, dict[str, str | None]]:
        """role -> {replica: node id} as the replicas report it now."""
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
        return ray.get_actor(name, namespace=self.namespace)

    def stop(self) -> None:
        """Stop collectors first (they drain), then bridges, then the logger groups."""
        drain(self.namespace, self.ingest, "stop", 30)  # the source first: nothing new enters
        for name in self.ingest:
            try:
                ray.kill(self.actor(name), no_restart=True)
            except Exception as err:
                log.info("ingest %s: %r", name, err)
        drain(self.namespace, self.collectors, "shutdown", 60)
        if self.supervisor is not None:  # with it the bridges and the drained collectors
            stop_supervisor(self.supervisor, 60)
            self.supervisor = None
        for group in self.logger_groups:
            group.shutdown()
        self.logger_groups.clear()


def _wait_logger_empty(client: Any, timeout_s: float = 300.0) -> None:
    """Block until a logger group holds nothing JetStream lacks (what it held is handed
    over); raise, keeping the group, if that does not happen in time."""

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
    port_chooser: PortChooser | None = None,
) -> CollectionTier:
    """Start loggers, then bridges and collectors under one supervisor, then the stream
    pattern's ingest nodes; returns once every bridge and collector serves.

    The collectors share `collector_port` (default `roles.collector.port`) with
    SO_REUSEPORT. Port 0: one free port, chosen by `port_chooser` (default `free_ports`)
    and chosen again, bridges and collectors started again, if another process takes it
    before they bind (`deploy_on_port`); a given or configured port that is taken fails
    with `PortTakenError` naming it (`tier.collector_port` is the port they serve)."""
    ns, state = cfg.ray.namespace, str(cfg.state_path)
    tier = CollectionTier(cfg=cfg, namespace=ns, nats_url=nats_url, udp_port=udp_port)
    (loggers,) = deploy([logger_role(cfg)], namespace=ns, state_dir=state)
    tier.logger_groups = [group for group, _ in loggers.groups]
    tier.loggers = [client for _, client in loggers.groups]
    tier.options = {
        "bridge": dict(bridge_options or {}),
        "collector": dict(collector_options or {}),
    }
    given = (
        "it was given" if collector_port is not None else "it is roles.collector.port in the config"
    )
    port = cfg.roles.collector.port if collector_port is None else collector_port

    def build(chosen: int) -> list[RoleSpec]:
        # replicas share the port with SO_REUSEPORT, so it is fixed up front
        bridges = bridge_role(cfg, nats_url=nats_url, loggers=tier.loggers, options=bridge_options)
        collectors = collector_role(
            cfg,
            nats_url=nats_url,
            loggers=tier.loggers,
            bridges=bridges.names,
            port=chosen,
            udp_port=udp_port,
            namespace=ns,
            options=collector_options,
        )
        tier.bridges, tier.collectors = bridges.names, collectors.names
        return [bridges, collectors]

    try:
        (started_bridges, started_collectors), tier.collector_port = deploy_on_port(
            build,
            role="collector",
            port=port,
            given=given,
            namespace=ns,
            state_dir=state,
            chooser=port_chooser,
        )
    except PortTakenError:
        for group in tier.logger_groups:  # nothing else of the tier runs: no tier to stop
            group.shutdown()
        raise
    tier.supervisor = started_bridges.supervisor
    for name in tier.collectors:
        tier.udp_port = started_collectors.answers[name]["udp_port"]
    for stream, sc in cfg.streams.items():
        if sc.source.url:
            ingest = ingest_role(
                stream,
                sc.source.url,
                sc.source.kind,
                replicas=sc.source.k + 1,
                nats_url=nats_url,
                state_dir=state,
                config=cfg.to_dict(),
            )
            deploy([ingest], namespace=ns, state_dir=state)
            tier.ingest += ingest.names
    return tier
