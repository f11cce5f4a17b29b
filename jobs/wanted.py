"""The analysis driver's wanted set: which jobs should run, kept in its checkpoint store.

Exists so that the one piece of state the driver's Ray methods change (`start`, `stop`,
`recompute`'s pause) and its reconcile thread reads has one owner with one lock, and so that
what survives a restart (the configured jobs, plus those started, minus those stopped) can
be tested on a checkpoint store alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from runtime.errors import JobError
from runtime.job_specs import JobSpec, decode_spec, encode_spec

if TYPE_CHECKING:
    from runtime.state.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

__all__ = ["WantedJobs"]


class WantedJobs:
    """The wanted jobs and the jobs paused for a recompute; read and change them under
    `lock` (the reconcile thread takes a `snapshot`). `restore` before the first change.

    Args:
        configured: the jobs of the driver's configuration, wanted unless stopped.
    """

    def __init__(self, configured: Mapping[str, JobSpec]) -> None:
        self.configured = dict(configured)
        self.lock = threading.Lock()
        self.jobs: dict[str, JobSpec] = {}
        self.paused: set[str] = set()  # jobs being recomputed: not running

    def restore(self, store: CheckpointStore) -> None:
        """The wanted set as the store keeps it: the configured jobs not stopped, and the
        started ones (a stored spec that no longer decodes is dropped, with an error)."""
        self._jobs_ns = store.namespace("jobs")
        self._stopped_ns = store.namespace("stopped")
        wanted = {
            n: s for n, s in self.configured.items() if self._stopped_ns.get(n.encode()) is None
        }
        for key, blob in self._jobs_ns.scan():
            try:
                spec = decode_spec(blob)
            except JobError as err:
                log.error("analysis driver: dropping stored job %r: %s", key, err)
                continue
            wanted[spec.name] = spec
        with self.lock:
            self.jobs = wanted

    def snapshot(self) -> tuple[dict[str, JobSpec], set[str]]:
        """The wanted jobs and the paused ones, as of now."""
        with self.lock:
            return dict(self.jobs), set(self.paused)

    def want(self, spec: JobSpec) -> JobSpec | None:
        """Want `spec` from now on, also after restarts. Refused when a job of its name is
        wanted with another spec: that spec is returned, and nothing changes."""
        with self.lock:
            running = self.jobs.get(spec.name)
            if running is not None and running != spec:
                return running
            self.jobs[spec.name] = spec
        self._jobs_ns.put(spec.name.encode(), encode_spec(spec))
        self._stopped_ns.delete(spec.name.encode())
        return None

    def resume(self, name: str) -> None:
        """Job `name` is no longer paused (its recompute ended): it runs again."""
        with self.lock:
            self.paused.discard(name)

    def unwant(self, name: str) -> bool:
        """Stop wanting job `name`, also after restarts; whether it was wanted."""
        with self.lock:
            known = self.jobs.pop(name, None) is not None
        self._jobs_ns.delete(name.encode())
        if name in self.configured:
            self._stopped_ns.put(name.encode(), b"1")
        return known
