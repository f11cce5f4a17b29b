"""MessageLogger: the collection tier's durable message log (book ch. 2, RBML/SBML/HML).

Nothing is answered as accepted before it is on all k+1 logger replicas. Layers, bottom up,
one module each:

- `records`: the on-disk format (records, namespaces, LevelDB keys); `errors`: `LogFull`
  and `LogUnavailable`, what the log answers instead of an acknowledgement.
- `store.LogStore` (with `txn._Txn`): the LevelDB data path, no Ray. Every mutating call is
  ONE synced write batch (group commit), counters included, so a crash leaves all of a call
  or none of it. An in-memory index of the entries, read from disk at open, spares appends
  and forgets their reads.
- `writer.LogWriter`: a pykka actor owning one `LogStore`, so blocking LevelDB work runs off
  the Ray actor's event loop; a `LocalSupervisor` restarts it (reopening the store) when it
  fails.
- `replica.LoggerReplica`: the Ray actor of one replica; every mutating call carries the
  writer's epoch and is fenced (`runtime.state.replication`); the fence is persisted in the
  store's `meta`.
- `group.LoggerGroup`: the picklable client Collector and Bridge hold: writes go to every
  replica of the in-sync set and succeed only when all acknowledged; reads go to the
  primary. `membership.Membership` keeps that set for it: drops a silent member under a
  new epoch, follows newer configurations, heals and promotes (`in_sync`: the pure rules).
- `offline`: `inspect` and `settle_parked`, the operator's tools on stopped stores.

Entry state machine (one key; "gone" is also where a key never logged stays). Entries are
keyed by (stream, event id), as JetStream dedups Nats-Msg-Id per stream:

    (absent) --append--> transient --forget (ack)--> gone
    transient --fail--> failed(attempts=1) --forget (ack)--> gone
    failed(n) --fail--> failed(n+1)   (next_retry_ms = now + retry_delay_ms(n+1))

`forget`/`fail` of an id the log does not hold do nothing (a late ack or failure report of
an entry already completed must not resurrect it). Re-appending an id the log holds does
nothing either; re-appending one it already forgot logs it again (the dedup window of
JetStream, keyed by the same id, absorbs the resend).

Token state (request/acknowledge, one token for the events of one request):
logged (some event still transient) -> failed (some event in `failed`) -> queued (every
event acked; the seqs JetStream gave them are kept). Tokens with events still in the log
never expire; of the completed ones the newest `max_done_tokens` are kept (a count bound,
no clock): an older token answers `None` ("unknown or expired").
"""

from __future__ import annotations

from actors.queue.logger.errors import LogFull, LogUnavailable
from actors.queue.logger.group import LoggerGroup, catch_up_all, replace_replica
from actors.queue.logger.offline import inspect, settle_parked
from actors.queue.logger.records import PARKED_MS, FailedEntry, LogKey, TokenState, key_of
from actors.queue.logger.replica import LoggerReplica
from actors.queue.logger.store import FAULT_SUFFIX, LogStore
from actors.queue.logger.writer import LogWriter, WriterClient

__all__ = [
    "FAULT_SUFFIX",
    "PARKED_MS",
    "FailedEntry",
    "LogFull",
    "LogStore",
    "LogUnavailable",
    "LogWriter",
    "LoggerGroup",
    "LogKey",
    "LoggerReplica",
    "TokenState",
    "WriterClient",
    "catch_up_all",
    "inspect",
    "key_of",
    "replace_replica",
    "settle_parked",
]
