"""Starting, scaling and stopping the Gateway replicas under their supervisor."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from actors.access.gateway import SUPERVISOR
from runtime.config import Config, GatewayOptions, gateway_options

log = logging.getLogger(__name__)


def gateway_names(replicas: int) -> list[str]:
    return [f"gateway-{i}" for i in range(replicas)]


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
) -> Any:
    """The child spec of one gateway replica, softly pinned to `node`.

    `options` default to the config's `[gateway.options]`; a mapping is checked here as
    `load` checks the file (ConfigError names the key), not in the restarting actor."""
    from runtime.placement import affinity
    from runtime.supervision import ChildSpec

    return ChildSpec(
        id=name,
        start="actors.access.gateway:Gateway",
        kwargs={
            "state_dir": str(cfg.state_path),
            "name": name,
            "config": cfg.to_dict(),
            "nats_url": nats_url,
            "port": port,
            "named_filters": dict(named_filters or {}),
            "token_streams": dict(token_streams or {}),
            "options": _typed(options),
        },
        ray_options={"num_cpus": 0, **affinity(node)},
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
) -> list[str]:
    """Start `replicas` gateways (default `roles.gateway.replicas`) under the `gateways`
    supervisor, sharing `port` (default `roles.gateway.port`; 0 picks one free port for
    all) with SO_REUSEPORT, one per node while nodes last; returns their actor names once
    every one serves."""
    from runtime.nats import free_port
    from runtime.placement import alive_nodes, plan
    from runtime.ray_supervisor import start_supervisor
    from runtime.supervision import Intensity, Strategy

    ns = cfg.ray.namespace
    n = replicas or cfg.roles.gateway.replicas
    port = cfg.roles.gateway.port if port is None else port
    port = port or free_port()
    names = gateway_names(n)
    specs = [
        gateway_spec(
            cfg,
            name,
            nats_url=nats_url,
            port=port,
            named_filters=named_filters,
            token_streams=token_streams,
            options=options,
            node=node,
        )
        for name, node in zip(names, plan(n, alive_nodes()), strict=True)
    ]
    start_supervisor(
        SUPERVISOR,
        specs,
        state_dir=str(cfg.state_path),
        namespace=ns,
        ray_options={"num_cpus": 0},
        strategy=Strategy.ONE_FOR_ONE,
        intensity=Intensity(max_restarts=20, period_s=60.0),
    )
    for name in names:
        wait_gateway(cfg, name, timeout_s)
    return names


def _typed(options: GatewayOptions | Mapping[str, Any] | None) -> GatewayOptions | None:
    if options is None or isinstance(options, GatewayOptions):
        return options
    return gateway_options(options)


def wait_gateway(cfg: Config, name: str, timeout_s: float = 120.0) -> dict[str, Any]:
    import ray

    from runtime.waiting import wait_until

    return wait_until(
        lambda: ray.get(
            ray.get_actor(name, namespace=cfg.ray.namespace).endpoints.remote(), timeout=30
        ),
        timeout=timeout_s,
        what=f"{name} serving",
        swallow=True,
    )


def scale_gateways(cfg: Config, names: list[str], n: int, timeout_s: float = 120.0) -> list[str]:
    """Resize the running gateways to `n` (in place in `names`) while clients read.

    A new replica is built like `names[0]` (same port, filters and tokens) on the node
    with the fewest gateways, and serves before this returns. A leaving one closes its
    clients with 1001 after flushing their cursors, so they reconnect to the others and
    resume where they were: no gap, no repeat.
    """
    import ray

    from runtime.placement import actor_nodes, alive_nodes, next_index, plan

    if n < 1:
        raise ValueError("a role needs at least 1 replica")
    ns = cfg.ray.namespace
    sup = ray.get_actor(SUPERVISOR, namespace=ns)
    template = ray.get(sup.child_spec.remote(names[0]), timeout=30)
    while len(names) < n:
        name = f"gateway-{next_index(names, 'gateway')}"
        placed = actor_nodes({x: ray.get_actor(x, namespace=ns) for x in names})
        node = plan(1, alive_nodes(), placed.values())[0]
        kwargs = {
            k: v for k, v in template.kwargs.items() if k not in ("state_dir", "name", "config")
        }
        spec = gateway_spec(cfg, name, node=node, **kwargs)
        ray.get(sup.add_child.remote(spec), timeout=60)
        wait_gateway(cfg, name, timeout_s)
        names.append(name)
    while len(names) > n:
        ray.get(sup.remove_child.remote(names.pop(), drain="shutdown"), timeout=timeout_s)
    return list(names)


def stop_gateways(cfg: Config, names: Sequence[str], timeout_s: float = 30.0) -> None:
    """Close every client cleanly (cursors flushed), then stop the supervisor and them."""
    import ray

    ns = cfg.ray.namespace
    for name in names:
        try:
            ray.get(ray.get_actor(name, namespace=ns).shutdown.remote(), timeout=timeout_s)
        except Exception as err:  # already gone: nothing to close
            log.info("gateway %s: %r", name, err)
    try:
        sup = ray.get_actor(SUPERVISOR, namespace=ns)
    except ValueError:
        return
    with contextlib.suppress(Exception):
        ray.get(sup.stop.remote(), timeout=timeout_s)
    ray.kill(sup, no_restart=True)
