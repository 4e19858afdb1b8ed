"""The trainer pool's wait for the final evaluation round: after its last step, with `eval.every`, the pool keeps
serving the final weights until the supervisor says the rounds, the final version's included, are played (or
`eval.final_timeout_s` passes, or a stop comes), so that the run's evaluation curve ends at the policy it saved.
Every rank waits together: rank 0 asks the supervisor (`EvalPending`) and `collectives.any_rank` carries its answer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from earl_stream import protocol as P
from earl_stream.config import EvalConfig
from earl_stream.workers.collectives import any_rank
from earl_stream.workers.common import StopFlag

__all__ = ["await_final_eval"]
log = logging.getLogger(__name__)


def await_final_eval(step: int, cfg: EvalConfig, *, rank: int, world_size: int, worker_id: str,
                     call: Callable[[P.Msg], P.Msg | None], stop: StopFlag) -> None:
    """Wait, every rank of the pool together, until the supervisor has no evaluation round pending, at most
    `cfg.final_timeout_s` (0 or no `cfg.every`: return at once); `call` sends rank 0's request to the supervisor
    (None: no answer)."""
    if not cfg.every or cfg.final_timeout_s <= 0:
        return
    deadline, said = time.monotonic() + cfg.final_timeout_s, 0.0
    while True:
        answer = call(P.EvalPending(worker_id=worker_id)) if rank == 0 else None
        reply = answer if isinstance(answer, P.EvalPendingReply) else None  # None: another rank, or no answer
        pending = reply is not None and reply.pending
        stopped, waiting, late = any_rank([bool(stop), pending, time.monotonic() > deadline], world_size)
        if stopped or not waiting:
            return
        if late:
            log.warning("step %d done: the evaluation round of version %d did not finish within "
                        "eval.final_timeout_s=%.0fs (%d of %d episodes back); the run ends without it", step,
                        reply.version if reply else -1, cfg.final_timeout_s, reply.done if reply else 0,
                        reply.total if reply else 0)
            return
        if reply is not None and time.monotonic() - said > 10:
            said = time.monotonic()
            log.info("step %d done: waiting for the evaluation round of version %d (%d of %d episodes back)",
                     step, reply.version, reply.done, reply.total)
        stop.wait(0.2)
