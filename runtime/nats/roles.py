"""Per-role NATS users: who may publish and subscribe to what, and who connects as whom.

With `nats.role_users = true` each role connects as its own NATS user whose permissions
allow what that role does and nothing else: a gateway reads streams but cannot publish
to a stream's subjects; a collector cannot read the results; only `admin` (tierflow
itself: stream set-up, status) has every subject. The embedded server gets the users in
its nats.conf with passwords generated once and kept in `<state_dir>/secrets` (0600);
an external server's operator creates the users (`role_permissions` is the list to give
them) and names them in `[nats.users.<role>]`.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from runtime.config import Config, NatsUser
from runtime.data.compaction import stream_subjects
from runtime.nats.lease import LEASE_BUCKET
from runtime.roles import NATS_ROLES

SECRETS_FILE = "nats-users.json"
# Names owned by other modules, repeated here so this module imports no actor code
# (tests/test_security.py checks they agree).
BUFFER_STREAM = "buffer"  # actors.collection.buffer.BUFFER_STREAM
CURSOR_BUCKET = "tierflow_cursors"  # actors.access.cursors.BUCKET
WEBHOOK_BUCKET = "tierflow_webhooks"  # actors.access.webhooks.BUCKET
WEBHOOK_DEADLETTER = "deadletter.webhooks"  # actors.access.webhooks.DEADLETTER_SUBJECT
RESULTS_BUCKET = "results"
# the operations console's view, put by tierflow itself, read by the gateways
STATUS_BUCKET = "tierflow_status"
STATUS_KEY = "console"
VERIFIER_KEY = "verifier"  # the last audit's verdict (cluster/audit.py)
# Subjects only the analysis tier writes (the results stream of runtime.config.system_streams):
# the bridge publishes what producers sent, so it must not reach them.
ANALYSIS_ONLY = ("results.",)

INBOX = "_INBOX.>"
# JetStream API calls every role makes to look around (account and stream info).
_LOOK = [
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.CONSUMER.INFO.*.*",
]
# Reading a stream: consumers (ephemeral, ordered, durable pull), message gets, acks,
# flow control. None of these can add a message to a stream.
_READ = [
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.DURABLE.CREATE.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.MSG.NEXT.>",
    "$JS.API.CONSUMER.NAMES.*",
    "$JS.API.CONSUMER.LIST.*",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.>",
    "$JS.ACK.>",
    "$JS.FC.>",
]


def _manage(*streams: str) -> list[str]:
    """Create or update these streams (never delete or purge them)."""
    return [f"$JS.API.STREAM.{op}.{s}" for s in streams for op in ("CREATE", "UPDATE")]


def _kv(bucket: str) -> list[str]:
    return [*_manage(f"KV_{bucket}"), f"$KV.{bucket}.>"]


def _read_only(stream: str) -> list[str]:
    """`_READ` narrowed to one stream: consumers on it, its messages, their acks."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.API.CONSUMER.NAMES.{stream}",
        f"$JS.API.CONSUMER.LIST.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.ACK.{stream}.>",
        "$JS.FC.>",
    ]


def _perm(publish: list[str], subscribe: list[str], responses: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "publish": {"allow": list(dict.fromkeys(publish))},
        "subscribe": {"allow": list(dict.fromkeys(subscribe))},
    }
    if responses:
        out["allow_responses"] = True
    return out


def role_permissions(cfg: Config) -> dict[str, dict[str, Any]]:
    """nats.conf `permissions` per role, from the configured streams (pure)."""
    subjects = [sub for n, s in cfg.streams.items() for sub in stream_subjects(s, n)]
    # the bridge publishes producers' events and dead letters, never analysis results
    bridged = [sub for sub in subjects if not sub.startswith(ANALYSIS_ONLY)]
    cursors = cfg.gateway.options.cursor_bucket or CURSOR_BUCKET
    return {
        "admin": _perm([">"], [">"]),
        "bridge": _perm([*_LOOK, *_manage(*cfg.streams), *bridged], [INBOX]),
        # the collector reads only the stream pattern's buffer: not results, not KV buckets
        "collector": _perm(
            [*_LOOK, *_read_only(BUFFER_STREAM), *_manage(BUFFER_STREAM)],
            [INBOX, "ingest.*"],
            True,
        ),
        "ingest": _perm(
            [*_LOOK, *_READ, *_manage(BUFFER_STREAM), f"{BUFFER_STREAM}.>", *_kv(LEASE_BUCKET)],
            [INBOX],
        ),
        # webhook senders hold their leases in the lease bucket (actors/access/webhooks.py)
        "gateway": _perm(
            [*_LOOK, *_READ, *_kv(cursors), *_kv(WEBHOOK_BUCKET), *_kv(LEASE_BUCKET)]
            + [WEBHOOK_DEADLETTER],
            [INBOX],
        ),
        "analysis": _perm(
            # the lease fences a warm pair of drivers (jobs/standby.py)
            [*_LOOK, *_READ, "results.>", "deadletter.>", *_kv(RESULTS_BUCKET), *_kv(LEASE_BUCKET)],
            [INBOX],
        ),
        # NATS producers of the pub/sub pattern: `ingest.<stream>` requests, nothing else
        "producer": _perm(["ingest.*"], [INBOX]),
    }


def secrets_path(cfg: Config) -> Path:
    return cfg.state_path / "secrets" / SECRETS_FILE


def _write_private(path: Path, data: bytes) -> None:
    """Replace `path` with a file that is 0600 from its creation on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def generated_passwords(cfg: Config, *, create: bool) -> dict[str, str]:
    """The embedded server's role passwords: read, or (create) made once and kept."""
    path = secrets_path(cfg)
    known: dict[str, str] = {}
    if path.is_file():
        known = json.loads(path.read_text())
    missing = [r for r in NATS_ROLES if r not in known]
    if missing and create:
        known.update({r: secrets.token_urlsafe(24) for r in missing})
        _write_private(path, json.dumps(known).encode())
    return known


def _user_name(cfg: Config, role: str) -> str:
    entry = cfg.nats.users.get(role)  # type: ignore[call-overload]
    return entry.user if entry is not None and entry.user else f"tierflow-{role}"


def server_users(cfg: Config) -> list[dict[str, Any]]:
    """The embedded server's `users` (name, password, permissions) for every role."""
    generated = generated_passwords(cfg, create=True)
    perms = role_permissions(cfg)
    out = []
    for role in NATS_ROLES:
        entry = cfg.nats.users.get(role)  # type: ignore[call-overload]
        password = entry.password if entry is not None and entry.password else generated[role]
        out.append(
            {"user": _user_name(cfg, role), "password": password, "permissions": perms[role]}
        )
    return out


def credentials(cfg: Config, role: str) -> NatsUser:
    """What `role` connects with.

    An explicit `[nats.users.<role>]` wins; with `role_users` on an embedded server the
    generated password; otherwise the shared `nats.user`/`password`/`token`/`creds`.
    """
    if role not in NATS_ROLES:
        raise ValueError(f"unknown NATS role {role!r}; one of {', '.join(NATS_ROLES)}")
    entry = cfg.nats.users.get(role)  # type: ignore[call-overload]
    if entry is not None and (entry.password or entry.token or entry.creds):
        return entry
    if cfg.nats.role_users and not cfg.nats.url:
        generated = generated_passwords(cfg, create=False)
        if role not in generated:
            raise RuntimeError(
                f"no generated NATS password for role {role!r} in {secrets_path(cfg)}: "
                "start the embedded server (tierflow up) with this state_dir first"
            )
        return NatsUser(user=_user_name(cfg, role), password=generated[role])
    n = cfg.nats
    return NatsUser(user=n.user, password=n.password, token=n.token, creds=n.creds)


__all__ = ["credentials", "role_permissions", "secrets_path", "server_users"]
