"""The gateway role: Gateway replicas sharing one port under the ``gateways`` supervisor,
as a `RoleSpec` built from the config, started, resized and stopped through
`cluster.deploy.deployer`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from cluster.deploy.deployer import (
    add_replica,
    deploy_on_port,
    drain,
    remove_replica,
    stop_supervisor,
    wait_ready,
)
from cluster.deploy.spec import RoleSpec, Start, SupervisorSpec, on_node, replica_name
from runtime.config import Config, GatewayOptions, gateway_options
from runtime.nats.server import PortChooser
from runtime.state.placement import next_index
from runtime.supervision.policy import ChildSpec

log = logging.getLogger(__name__)

ROLE = "gateway"
START = "actors.access.gateway:Gateway"
SUPERVISOR = "gateways"
READY = "endpoints"  # answers once the replica serves


def gateway_names(replicas: int) -> list[str]:
    return [replica_name(ROLE, i) for i in range(replicas)]


def gateway_spec(
    cfg: Config,
    name: str,
    *,
    nats_url: str,
    port: int,
    named_filters: Mapping[str, str] | None = None,
    token_streams: Mapping[str, Sequence[str]] | None = None,
    options: GatewayOptions | Mapping[str, Any] | None = None,
    node: str | None = None,
) -> ChildSpec:
    """The child spec of one gateway replica, softly pinned to `node`.

    `options`, `named_filters` and `token_streams` default to the config's
    (`[gateway.options]`, `gateway.filters`, `auth.consumer_streams`); an options mapping is
    checked here as `load` checks the file (ConfigError names the key), not in the
    restarting actor."""
    spec = ChildSpec(
        id=name,
        start=START,
        kwargs={
            "state_dir": str(cfg.state_path),
            "name": name,
            "config": cfg.to_dict(),
            "nats_url": nats_url,
            "port": port,
            # absent means the config's, as `tierflow up` passes them
            "named_filters": dict(cfg.gateway.filters if named_filters is None else named_filters),
            "token_streams": dict(
                cfg.auth.consumer_streams if token_streams is None else token_streams
            ),
            "options": _typed(options),
        },
        ray_options={"num_cpus": 0},
    )
    return on_node(spec, node)


def gateway_role(
    cfg: Config,
    nats_url: str,
    port: int,
    replicas: int | None = None,
    *,
    named_filters: Mapping[str, str] | None = None,
    token_streams: Mapping[str, Sequence[str]] | None = None,
    options: GatewayOptions | Mapping[str, Any] | None = None,
) -> RoleSpec:
    """`replicas` gateways (default `roles.gateway.replicas`) on one `port`, supervised
    one for one (20 restarts a minute before it escalates)."""
    children = [
        gateway_spec(
            cfg,
            name,
            nats_url=nats_url,
            port=port,
            named_filters=named_filters,
            token_streams=token_streams,
            options=options,
        )
        for name in gateway_names(replicas or cfg.roles.gateway.replicas)
    ]
    return RoleSpec(
        role=ROLE,
        children=tuple(children),
        start=Start.SUPERVISED,
        supervisor=SupervisorSpec(SUPERVISOR),
        ready=READY,
    )


def start_gateways(
    cfg: Config,
    nats_url: str,
    replicas: int | None = None,
    port: int | None = None,
    *,
    named_filters: Mapping[str, str] | None = None,
    token_streams: Mapping[str, Sequence[str]] | None = None,
    options: GatewayOptions | Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
    port_chooser: PortChooser | None = None,
) -> list[str]:
    """Start `replicas` gateways (default `roles.gateway.replicas`) under the `gateways`
    supervisor, sharing `port` (default `roles.gateway.port`) with SO_REUSEPORT, one per
    node while nodes last; returns their actor names once every one serves
    (`wait_gateway(cfg, name)["port"]` is the port).

    Port 0: one free port for all, chosen by `port_chooser` (default `free_ports`) and
    chosen again if another process takes it before they bind (`deploy_on_port`); a port
    given here or in the config that is taken fails with `PortTakenError` naming it."""
    given = "it was given" if port is not None else "it is roles.gateway.port in the config"
    port = cfg.roles.gateway.port if port is None else port

    def build(chosen: int) -> list[RoleSpec]:
        role = gateway_role(
            cfg,
            nats_url,
            chosen,
            replicas,
            named_filters=named_filters,
            token_streams=token_streams,
            options=options,
        )
        return [role]

    (deployed,), _ = deploy_on_port(
        build,
        role=ROLE,
        port=port,
        given=given,
        namespace=cfg.ray.namespace,
        state_dir=str(cfg.state_path),
        timeout_s=timeout_s,
        chooser=port_chooser,
    )
    return deployed.names


def _typed(options: GatewayOptions | Mapping[str, Any] | None) -> GatewayOptions | None:
    if options is None or isinstance(options, GatewayOptions):
        return options
    return gateway_options(options)


def wait_gateway(cfg: Config, name: str, timeout_s: float = 120.0) -> dict[str, Any]:
    return wait_ready(cfg.ray.namespace, name, READY, timeout_s)


def scale_gateways(cfg: Config, names: list[str], n: int, timeout_s: float = 120.0) -> list[str]:
    """Resize the running gateways to `n` (in place in `names`) while clients read.

    A new replica is built like `names[0]` (same port, filters and tokens) on the node
    with the fewest gateways, and serves before this returns. A leaving one closes its
    clients with 1001 after flushing their cursors, so they reconnect to the others and
    resume where they were: no gap, no repeat.
    """
    if n < 1:
        raise ValueError("a role needs at least 1 replica")
    ns = cfg.ray.namespace
    sup = ray.get_actor(SUPERVISOR, namespace=ns)
    template = ray.get(sup.child_spec.remote(names[0]), timeout=30)
    like = {k: v for k, v in template.kwargs.items() if k not in ("state_dir", "name", "config")}
    while len(names) < n:
        name = replica_name(ROLE, next_index(names, ROLE))
        spec = gateway_spec(cfg, name, **like)
        add_replica(sup, spec, namespace=ns, siblings=names, ready=READY, timeout_s=timeout_s)
        names.append(name)
    while len(names) > n:
        remove_replica(sup, names.pop(), timeout_s)
    return list(names)


def stop_gateways(cfg: Config, names: Sequence[str], timeout_s: float = 30.0) -> None:
    """Close every client cleanly (cursors flushed), then stop the supervisor and them."""
    ns = cfg.ray.namespace
    drain(ns, names, "shutdown", timeout_s)
    try:
        sup = ray.get_actor(SUPERVISOR, namespace=ns)
    except ValueError:
        return
    stop_supervisor(sup, timeout_s)
