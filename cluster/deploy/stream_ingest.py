"""Starting a stream's k+1 StreamIngest nodes (the book's stream pattern)."""

from __future__ import annotations

from typing import Any

import ray

from actors.collection.buffer import check_stream_name
from actors.collection.stream_ingest import StreamIngest
from runtime.ray_supervisor import DEFAULT_NAMESPACE, supervised_options


def start_stream_ingest(
    stream: str,
    url: str,
    kind: str = "auto",
    *,
    replicas: int = 2,
    nats_url: str,
    state_dir: str,
    namespace: str = DEFAULT_NAMESPACE,
    name_prefix: str = "ingest",
    ray_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Start (or get, if running) `replicas` = k+1 named, detached `StreamIngest` actors
    `{name_prefix}-{stream}-{i}`, spread over nodes where Ray can. One of them becomes
    active; the others stand by. `kwargs` go to `StreamIngest`."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    check_stream_name(stream)
    remote_cls = ray.remote(StreamIngest)
    handles = []
    for i in range(replicas):
        opts = supervised_options(
            f"{name_prefix}-{stream}-{i}",
            namespace,
            num_cpus=0,
            scheduling_strategy="SPREAD",
            **(ray_options or {}),
        )
        handles.append(
            remote_cls.options(**opts).remote(
                stream, url, kind, nats_url=nats_url, state_dir=str(state_dir), **kwargs
            )
        )
    return handles
