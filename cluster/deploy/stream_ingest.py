"""The ingest role of one stream: its k+1 StreamIngest nodes (the book's stream pattern)
as a `RoleSpec`, started through `cluster.deploy.deployer`."""

from __future__ import annotations

from typing import Any

from actors.collection.buffer import check_stream_name
from cluster.deploy.deployer import deploy
from cluster.deploy.spec import RoleSpec, Start
from runtime.supervision.policy import ChildSpec
from runtime.supervision.ray_actors import DEFAULT_NAMESPACE

ROLE = "ingest"
START = "actors.collection.stream_ingest:StreamIngest"


def ingest_role(
    stream: str,
    url: str,
    kind: str = "auto",
    *,
    replicas: int = 2,
    nats_url: str,
    state_dir: str,
    name_prefix: str = ROLE,
    ray_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> RoleSpec:
    """`replicas` = k+1 named, detached `StreamIngest` actors `{name_prefix}-{stream}-{i}`,
    spread over nodes where Ray can; `kwargs` go to `StreamIngest`."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    check_stream_name(stream)
    children = [
        ChildSpec(
            id=f"{name_prefix}-{stream}-{i}",
            start=START,
            args=(stream, url, kind),
            kwargs={"nats_url": nats_url, "state_dir": str(state_dir), **kwargs},
            ray_options={"num_cpus": 0, "scheduling_strategy": "SPREAD", **(ray_options or {})},
        )
        for i in range(replicas)
    ]
    return RoleSpec(role=ROLE, children=tuple(children), start=Start.DETACHED)


def start_stream_ingest(
    stream: str,
    url: str,
    kind: str = "auto",
    *,
    replicas: int = 2,
    nats_url: str,
    state_dir: str,
    namespace: str = DEFAULT_NAMESPACE,
    name_prefix: str = ROLE,
    ray_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Start (or get, if running) the ingest nodes of `stream` (see `ingest_role`) and
    return their handles. One of them becomes active; the others stand by."""
    spec = ingest_role(
        stream,
        url,
        kind,
        replicas=replicas,
        nats_url=nats_url,
        state_dir=state_dir,
        name_prefix=name_prefix,
        ray_options=ray_options,
        **kwargs,
    )
    (deployed,) = deploy([spec], namespace=namespace, state_dir=state_dir)
    return deployed.actors
