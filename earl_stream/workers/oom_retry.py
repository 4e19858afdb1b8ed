"""A trainer step that failed to allocate, retried under a new plan (`trainer.oom_recovery`): the trainer's
side of out-of-memory recovery (abandon the step, re-plan, retry).

Owns `OomRetry`: it runs a rank's part of a step under `oom_step.run_guarded` (one rank) or
`pool_abort.PoolGuard` (a pool of several ranks: every rank leaves the failed step within
`trainer.oom_abort_seconds`, agrees which rank failed, and the default process group is re-formed), then
re-binds the model to the re-formed group's meshes (`sharding.rebind`: the shards stay where they are), and
rank 0 alone reports the failure (`protocol.TrainerOom`: one report per failure, with the failing rank's
error and bytes and the fullest rank's peak). The supervisor corrects its memory model and re-plans
(`supervisor.oom_replan`); every rank learns whether a plan came back, and the pool claims the same step
again: the same rows, the new plan. A failure after any rank's optimizer stepped is raised as it is: the
pool resumes from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.workers.collectives import any_rank, max_over_ranks
from earl_stream.workers.mesh import TrainerMesh, pool_backend
from earl_stream.workers.oom_step import AllocationFailure, TrainerOutOfMemory, run_guarded
from earl_stream.workers.pool_abort import PoolGuard
from earl_stream.workers.sharding import apply_plan, rebind
from earl_stream.workers.train_step import StepResult

if TYPE_CHECKING:
    from earl_stream.workers.trainer import TrainerRank

log = logging.getLogger(__name__)


class OomRetry:
    """One rank's recovery from allocation failures (made once the rank's process group is up)."""

    def __init__(self, trainer: TrainerRank, *, collective_timeout_s: float) -> None:
        self.trainer = trainer
        t = trainer.cfg.trainer
        self.guard = None
        if trainer.world_size > 1:
            self.guard = PoolGuard(trainer.rank, trainer.world_size, backend=pool_backend(),
                                   abort_seconds=t.oom_abort_seconds,
                                   timeout=datetime.timedelta(seconds=collective_timeout_s))
        self.recovering: tuple[str, float] | None = None  # a step being retried: (the plan it first failed under, since)

    def train(self, step: int, metas: list, run: Callable[[], StepResult]) -> StepResult | None:
        """`run()`, or None when the step was abandoned and re-planned (claim it again)."""
        tr = self.trainer
        started = time.monotonic()
        if self.guard is None:
            outcome = run_guarded(run, tr.optimizer, tr.placement.device)
        else:
            outcome = self.guard.run(run, tr.optimizer, tr.placement.device)
        if isinstance(outcome, AllocationFailure):
            if self.guard is not None:
                failure = self.guard.reform()  # raises when a rank's optimizer stepped or a rank did not answer
                log.warning("step %d: every rank left the step %.2fs after it began; rank %d failed", step,
                            time.monotonic() - started, failure.rank)
                self._rebind()
                outcome = dataclasses.replace(outcome, error=f"rank {failure.rank}: {failure.error}",
                                              attempted_bytes=failure.attempted_bytes)
            self._replan(step, metas, outcome)
            return None
        if self.recovering is not None:
            failed, since = self.recovering
            M.TRAINER_OOM_RECOVERED.labels(failed).inc()
            log.warning("step %d: recovered from the allocation failure under %s: trained under plan %s, %.2fs lost "
                        "to it", step, failed, tr.placement.plan.label, started - since)
            self.recovering = None
        return outcome

    def _rebind(self) -> None:
        """The model, optimizer and reference model on the re-formed group's meshes, under the same plan."""
        tr = self.trainer
        tr.mesh = TrainerMesh(tr.world_size, tr.rank, tr.placement.device)
        placement = tr.mesh.placement(tr.placement.plan)
        if tr.placement.mesh is not None or tr.placement.ep_mesh is not None:  # DTensors of the old meshes
            relaid = rebind(tr.model, tr.optimizer, placement, tr._make_optimizer)
            tr.model, tr.optimizer = relaid.model, relaid.optimizer or tr.optimizer
            if tr.ref_model is not None:
                tr.ref_model = rebind(tr.ref_model, None, placement, tr._make_optimizer).model
        apply_plan(tr.model, placement, extra_models=[tr.ref_model] if tr.ref_model is not None else [])
        tr.placement = placement

    def _replan(self, step: int, metas: list, failure: AllocationFailure) -> None:
        """Report the abandoned step (rank 0); the supervisor's next claim of it carries the plan to retry
        under. Collective in a pool: every rank learns whether a plan came back."""
        tr = self.trainer
        lengths = [m.total_tokens for m in metas]
        failed = tr.placement.plan.label
        peak = max_over_ranks(tr.peak_memory.step_peak(), tr.world_size)
        why = ""
        if tr.rank == 0:
            log.warning("step %d: failed to allocate under plan v%d (%s, micro-batch %d tokens; %d rows, %d tokens, "
                        "longest %d): %s; abandoned with nothing applied, asking for a new plan", step, tr.plan_version,
                        failed, tr.step_cfg.micro_batch_tokens, len(lengths), sum(lengths), max(lengths, default=0),
                        failure.error)
            reply = tr._call(P.TrainerOom(worker_id=tr.worker_id, step=step, plan_version=tr.plan_version,
                                          rows=len(lengths), tokens=sum(lengths), longest=max(lengths, default=0),
                                          attempted_bytes=failure.attempted_bytes, peak_bytes=peak, error=failure.error))
            if not isinstance(reply, P.OomReplanned) or reply.plan is None:
                why = reply.message if isinstance(reply, P.OomReplanned) else str(reply)
            else:
                log.warning("step %d: the supervisor re-planned: %s", step, reply.message)
        if any_rank([tr.rank == 0 and bool(why)], tr.world_size)[0]:
            raise TrainerOutOfMemory(f"step {step} failed to allocate under plan {failed} ({failure.error}) and no plan "
                                     f"is left to retry it under: {why or 'rank 0 got no plan from the supervisor'}")
        self.recovering = self.recovering or (failed, failure.started)
