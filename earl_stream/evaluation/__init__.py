"""Evaluation of a policy on held-out items of an environment: the held-out sets
(`evaluation.heldout`), the unbiased pass@k estimator and the summaries (`evaluation.passk`), the
runner that plays items through the engine and agent loop RL uses (`evaluation.runner`), and the
loading of a model from a directory, a run or a checkpoint of any kind (`evaluation.models`).

`earl-stream eval` (earl_stream/cli/eval.py) and `bench/heldout.py` call these; evaluation during
training is scheduled by the supervisor (`earl_stream.supervisor.eval_rounds`) and played by the
rollout workers (`evaluation.worker`), never trained on.
"""

from earl_stream.evaluation.heldout import HeldOutSet, HeldOutUnavailable, check_held_out, held_out_set
from earl_stream.evaluation.passk import EpisodeOutcome, EvalSummary, pass_at_k, summarize

__all__ = ["EpisodeOutcome", "EvalSummary", "HeldOutSet", "HeldOutUnavailable", "check_held_out", "held_out_set",
           "pass_at_k", "summarize"]
