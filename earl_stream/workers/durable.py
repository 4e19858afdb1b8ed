"""A rollout worker's side of durable experience: at start it serves again what its slot of the run
directory holds (and tells the supervisor, whose ledger takes back what it still waits for); at each
trainer checkpoint (learned from a heartbeat reply) and on a clean stop it persists what it holds.

The format, the slot and its lock are `earl_stream.store.durable`'s; which samples may be trained is
the supervisor's (`supervisor/recovery.py`).
"""

from __future__ import annotations

import logging
import threading
import time

from earl_stream import protocol as P
from earl_stream.config import RunConfig
from earl_stream.errors import EarlError, StoreError
from earl_stream.store.durable import Identity, Slot, model_identity
from earl_stream.store.experience import ExperienceWriter
from earl_stream.workers.common import model_path

log = logging.getLogger(__name__)


class DurableSamples:
    def __init__(self, cfg: RunConfig, run_id: str, writer: ExperienceWriter) -> None:
        self.slot = Slot(cfg.run_dir)
        self.identity = Identity(run_id, model_identity(model_path(cfg)))
        self.writer = writer
        self.version = -1  # the checkpoint the last generation went with
        self._lock = threading.Lock()  # one generation at a time (a checkpoint's may still be writing at a stop)

    @classmethod
    def open(cls, cfg: RunConfig, run_id: str, writer: ExperienceWriter) -> DurableSamples | None:
        """None when durable experience is off, the supervisor names no run, or the run directory is
        not writable here (a worker on another host without it): the worker then runs as before."""
        if not cfg.store.durable_experience or not run_id:
            return None
        try:
            return cls(cfg, run_id, writer)
        except OSError as exc:
            log.warning("durable experience off: cannot use %s here (%s); samples held are lost if this worker "
                        "dies", cfg.run_dir, exc)
            return None

    def recover(self, client: P.ControlClient, worker_id: str) -> int:
        """Serve the slot's persisted samples and register them; frees what the supervisor refuses.
        Returns the samples taken back. Never raises for a bad file or a refusal (they are re-played)."""
        path, samples = self.slot.load(self.identity)
        if not samples:
            return 0
        rows = []
        try:
            for meta, fields in samples:
                rows.append(self.writer.restore(meta, fields))
        except StoreError as exc:  # e.g. more than this node may hold: serve none of them
            self.writer.free([r.sample_id for r in rows])
            log.warning("could not serve the samples of %s again (%s): they are re-played", path, exc)
            return 0
        try:
            reply = client.call_retry(P.RecoverSamples(worker_id=worker_id, rows=rows, source=str(path)),
                                      deadline_s=60, what="RecoverSamples")
        except EarlError as exc:
            reply = P.Recovered(refused=[r.sample_id for r in rows])
            log.warning("could not register the samples of %s (%s): they are re-played", path, exc)
        if not isinstance(reply, P.Recovered):  # an older supervisor without durable experience
            reply = P.Recovered(refused=[r.sample_id for r in rows])
        self.writer.free(reply.refused)
        log.info("resume: %d samples recovered from %s, %d refused by the supervisor (already trained or re-played)",
                 len(reply.accepted), path, len(reply.refused))
        return len(reply.accepted)

    def persist(self, checkpoint_version: int, why: str) -> None:
        """Write what this worker holds as a new generation (errors are logged: the run goes on).
        Thread-safe; samples freed meanwhile may still be in it (the ledger refuses them later)."""
        with self._lock:
            if why == "checkpoint" and checkpoint_version <= self.version:
                return  # asked twice while the first was writing
            start = time.monotonic()
            samples = self.writer.held_samples()
            try:
                path = self.slot.write(self.identity, checkpoint_version, samples)
            except OSError as exc:
                log.warning("could not persist %d samples (%s) in %s: %s", len(samples), why, self.slot.dir, exc)
                return
            self.version = checkpoint_version
        log.info("persisted %d samples (%s, checkpoint %d) to %s in %.3fs", len(samples), why, checkpoint_version,
                 path, time.monotonic() - start)

    def close(self) -> None:
        self.slot.close()
