"""Tierflow's errors: one root a caller can catch, and the foundation's shared errors.

`TierflowError` is the root of every error tierflow raises on purpose. A caller (the CLI,
a program embedding tierflow, a test) catches it to tell "tierflow refused or failed, and
the message says why" from a bug (a KeyError, a TypeError) with one `except`. Each error
keeps the builtin base it had as a second base (ValueError for bad input, RuntimeError for
a failed operation, TimeoutError, ConnectionError), so an `except ValueError` written
before the root existed still catches what it caught.

This module imports nothing of tierflow, so every tier can import it; an error is declared
in the module that raises it, subclassing `TierflowError` there. The tree, by tier (the
module in brackets; "also X": its builtin base):

runtime (the foundation)
    ConfigError             a bad configuration value [here; also ValueError]
    FencedError             a writer whose epoch or lease was superseded: refused, nothing
                            written [here]; `except FencedError` catches every kind:
      EpochFenced           a replica refused an older epoch's write [runtime.state.replication]
      LeaderFenced          a buffer writer no longer leads its stream
                            [actors.collection.buffer; also RuntimeError]
      LeaseFenced           a driver lost the lease its result writes need [jobs.sink; also
                            a SinkError]
    WaitTimeout             a bounded wait's condition did not hold by its deadline
                            [runtime.waiting; also TimeoutError]
    CheckpointError         a LevelDB checkpoint store failed [runtime.state.checkpoint]
      CheckpointLockedError   another process holds the store's lock
      CheckpointCorruptError  LevelDB found corruption in the store
    NoKey                   an event has no usable compaction key [runtime.data.compaction;
                            also ValueError]
    ScanIncomplete          a scan could not read its whole range: absence is not proven
                            [runtime.nats.publisher]
    FilterError             a filter that does not compile [runtime.data.query; also ValueError]
    SqlRefused              a SQL query this system does not run [runtime.data.sql_check; also
                            ValueError]
    PlacementError          a replica group was not placed in time [runtime.state.replication;
                            also RuntimeError]
    ReplicaGroupError       replicas did not start or acknowledge an epoch in time
                            [runtime.state.replication; also RuntimeError]
    EngineError             an engine could not be started or reached [runtime.engines.services;
                            also RuntimeError]
    NatsServerError         nats-server could not be found, started or made ready
                            [runtime.nats.server; also RuntimeError]
    PortTakenError          a server's port is held by another process (errno EADDRINUSE)
                            [runtime.binding; also OSError]
actors.queue (the message log)
    LogFull                 the log is at its bound: the whole batch refused, nothing written
    LogUnavailable          a log replica did not take a write
actors.collection
    BadInput                a request the collector refuses (HTTP status and reason)
    Overloaded              too many events already waiting to be flushed (a 503)
    QueueRefused            mode none: JetStream did not acknowledge, no log holds the
                            events [actors.collection.ingest]
    BufferWriteError        frames still not stored after every retry (also RuntimeError)
    SourceUnreachable       a collection source (WebSocket, SSE, NDJSON over HTTP) failed or
                            carried nothing `max_attempts` connections in a row (also
                            RuntimeError)
actors.access (gateways and their client)
    Problem                 a gateway request refused (HTTP status, WebSocket close code)
    GatewayError            the gateway refused a subscription; not retried (client side)
    GatewayUnavailable      no gateway accepted the subscription in time (also
                            ConnectionError)
    ConsumerLost            a reader's JetStream consumer stopped answering: reopen it
    WebhookError            a webhook registration that cannot be accepted (also ValueError)
jobs (the analysis tier)
    JobError                a job spec or a JSON path is invalid [here; also ValueError]
    AnalysisDriverError     the analysis driver cannot be reached or refused a request
                            [jobs.driver; also RuntimeError]
    SinkError               results could not be made durable: the batch fails, is replayed
      LeaseFenced           (above)
    JetStreamSourceError    a Spark job's JetStream source is misconfigured or cannot read
                            (also RuntimeError)
      AgedOutError          its start sequence is below the stream's first: events gone
    HistoryGap              live-tail events a reader needed were purged before it read them
    CopyError               a position's copy cannot be read or does not match
    ArchiveOwnerError       the archive's directory belongs to another checkpoint
    SqlTimeout              an ad-hoc query ran past its timeout (also TimeoutError)
cluster (operations)
    DriverConflict          a driver of that name runs otherwise than asked (a JobError)
    NoNats                  no NATS to read from: no `nats.url`, no running tierflow
    LabError                a lab command failed [cluster.lab.hosts; also RuntimeError]
    LabPlanError            a lab that cannot be made as asked [cluster.lab.plan; also
                            ValueError]
"""

from __future__ import annotations

__all__ = ["ConfigError", "FencedError", "JobError", "TierflowError"]


class TierflowError(Exception):
    """Anything tierflow raises on purpose; the message says what happened.

    The one thing a caller catches to handle every refusal and failure of tierflow's own
    (a bug, such as a KeyError, is not one). Subclasses keep a builtin second base where
    they had one, so narrower `except` clauses keep working.
    """


class ConfigError(TierflowError, ValueError):
    """A bad configuration value; the message names the key and the expected form.

    Here, not in `runtime.config`, so the compilers the config validates with
    (`runtime.data.query`, `runtime.data.logic`) can raise it without importing the config.
    """


class FencedError(TierflowError):
    """A writer whose epoch or lease was superseded: another writer owns the writes now.

    The write was refused before anything of it was stored; the refused writer must stop or
    adopt the newer epoch. Subclasses say what superseded it (`EpochFenced`,
    `LeaderFenced`, `LeaseFenced`); `except FencedError` catches them all.
    """


class JobError(TierflowError, ValueError):
    """A job spec, a JSON path or a duration is invalid; the message names the field and the
    fix. Here because specs are checked where the config loads (`runtime.job_specs`)."""
