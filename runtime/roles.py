"""The roles of a tierflow pipeline, by name: the ones that scale and the ones NATS knows.

A role is a kind of process of the pipeline. Two sets of them matter, and each is a tuple
of names read from the one type in `runtime.config` that defines it, so the config, the
operating layer and the NATS permissions cannot disagree:

- `SCALABLE_ROLES`: the roles with a ``[roles.<role>]`` table (replicas, k, port,
  autoscaling), the ones ``tierflow scale`` and the autoscaler resize: the fields of
  `RolesConfig` (collector, logger, bridge, gateway).
- `NATS_ROLES`: the identities that connect to NATS, each as its own user when
  ``nats.role_users`` is on: the values of `NatsRole`. The logger never reaches NATS, so it
  is absent; ingest (the stream pattern) and analysis are deployed but not resized; admin
  (tierflow itself) and producer (pub/sub producers) are not deployed at all.
"""

from __future__ import annotations

from typing import get_args

from runtime.config import NatsRole, RolesConfig

SCALABLE_ROLES: tuple[str, ...] = tuple(RolesConfig.__struct_fields__)
# the analysis driver's Ray actor name (in the config's namespace): the gateway finds it by
# this name to run `/v1/sql`, the operating layer to manage jobs
ANALYSIS_DRIVER = "tierflow-analysis"
NATS_ROLES: tuple[str, ...] = get_args(NatsRole)

__all__ = ["ANALYSIS_DRIVER", "NATS_ROLES", "SCALABLE_ROLES"]
