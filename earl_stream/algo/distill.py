"""On-policy distillation (`algo.distill`): a teacher scores the tokens the student sampled, and the
per-token reverse KL between them (student log-prob - teacher log-prob on the sampled token, an
unbiased single-sample estimate of KL(student || teacher) at that position) trains the student.

Owns the teacher's scoring engine (`TeacherScorer`: the teacher model in the rollout worker, one
prefill per finished episode group, no sampling), the check that teacher and student share a
tokenizer, and the two ways the KL enters training, for any advantage estimator:

- mode `reward` (a sequence-level reward): each episode's reward becomes r - coef x sum over its loss
  tokens of (behaviour log-prob - teacher log-prob) before the estimator computes advantages. The
  rollout worker records that sum in the sample's `info["distill_kl"]`, so the trainer reads it from
  the claim's metadata on every rank, under every layout, without pulling or reducing anything.
- mode `loss`: coef x k2 = coef x (log pi - log teacher)^2 / 2 per loss token, added to the policy loss
  with the step's token weights. On the student's own samples its gradient is (log pi - log teacher)
  grad log pi, the reverse KL's gradient; the k1 estimate itself has zero expected gradient there.

The teacher's log-probs travel as the sample's token field `teacher_logprobs [T] float32`
(`earl_stream.records`), 0 where the loss mask is 0, taken at the rollout temperature like the
behaviour log-probs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from earl_stream.errors import ModelError
from earl_stream.records import SampleRecord

__all__ = ["TeacherScorer", "distill_loss", "distill_problems", "padded_field", "reward_penalties", "reverse_kl",
           "tokenizer_mismatch"]

log = logging.getLogger(__name__)

INFO_KEY = "distill_kl"  # a sample's summed reverse KL over its loss tokens (nats)
FIELD = "teacher_logprobs"


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why two tokenizers cannot share token ids (None when they can): vocabulary or special tokens differ."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        only = sorted(set(a.items()) ^ set(b.items()))[:3]
        return f"vocabularies differ ({len(a)} vs {len(b)} tokens; e.g. {only})"
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} differs ({getattr(student, name, None)} vs {getattr(teacher, name, None)})"
    return None


def distill_problems(cfg: Any) -> list[str]:
    """Config-load check of `algo.distill`: the teacher is a model directory whose tokenizer equals the
    student's (the embedded default's is checked once built, by the rollout worker)."""
    from earl_stream.model.loading import load_tokenizer

    d = cfg.algo.distill
    if not (Path(d.teacher) / "config.json").is_file():
        return [f"algo.distill.teacher: {d.teacher} is not a Hugging Face model directory (no config.json)"]
    from earl_stream.model.hub import local_model_dir

    try:
        folder = local_model_dir(cfg.model)
    except ModelError as exc:
        return [f"model.path: {exc}"]
    student_dir = str(folder) if folder else ""
    if not student_dir:
        from earl_stream.model.default import default_model_dir
        student_dir = str(default_model_dir(warm_start_steps=cfg.model.warm_start_steps))
        if not (Path(student_dir) / "config.json").is_file():
            return []
    try:
        why = tokenizer_mismatch(load_tokenizer(student_dir), load_tokenizer(d.teacher))
    except ModelError as exc:
        return [f"algo.distill.teacher: {exc}"]
    return [] if why is None else [f"algo.distill.teacher: its tokenizer differs from the student's ({student_dir}): "
                                   f"{why}; the teacher must score the student's token ids"]


class TeacherScorer:
    """The teacher model on the rollout worker: per-token log-probs of finished episodes by one prefill."""

    def __init__(self, teacher_dir: str, student_tokenizer: Any, *, device: torch.device | str = "cpu",
                 temperature: float = 1.0) -> None:
        from earl_stream.model.loading import load_model

        self.model, tokenizer = load_model(teacher_dir)
        why = tokenizer_mismatch(student_tokenizer, tokenizer)
        if why is not None:
            raise ModelError(f"algo.distill.teacher {teacher_dir}: its tokenizer differs from the student's: {why}")
        self.device = torch.device(device)
        self.model.to(self.device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.temperature = temperature
        self.pad_id = int(tokenizer.pad_token_id or 0)

    @torch.no_grad()
    def logprobs(self, sequences: Sequence[np.ndarray]) -> list[np.ndarray]:
        """log p_teacher(token_t | tokens_<t) [T] float32 of each sequence (0 at t = 0), one right-padded
        forward over all of them (causal attention never looks at the pads)."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
        logits = self.model(input_ids=ids.to(self.device), use_cache=False).logits[:, :-1].float()
        if self.temperature > 0 and self.temperature != 1.0:
            logits = logits / self.temperature
        picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None].to(self.device))[..., 0].cpu()
        return [np.concatenate([[0.0], picked[i, : len(s) - 1].numpy()]).astype(np.float32)
                for i, s in enumerate(sequences)]

    def score(self, records: Sequence[SampleRecord]) -> list[SampleRecord]:
        """The records with `teacher_logprobs` (0 off the loss mask) and `info["distill_kl"]`."""
        if not records:
            return []
        out = []
        for r, lp in zip(records, self.logprobs([r.input_ids for r in records])):
            lp = lp * (r.loss_mask > 0)
            kl = float(reverse_kl(r.behaviour_logprobs, lp, r.loss_mask).sum())
            out.append(dataclasses.replace(r, teacher_logprobs=lp.astype(np.float32), info={**r.info, INFO_KEY: kl}))
        return out


def reverse_kl(student: np.ndarray, teacher: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Per-token reverse-KL estimate (student - teacher log-prob) on loss tokens, 0 elsewhere [T] float64."""
    return (np.asarray(student, np.float64) - np.asarray(teacher, np.float64)) * (np.asarray(mask) > 0)


def reward_penalties(metas: Sequence[Any], coef: float) -> np.ndarray:
    """[N] float64: coef x each sample's summed reverse KL (from its metadata's info), to subtract from
    its reward. A sample no teacher scored is refused: its reward would silently go unpenalised."""
    out = np.zeros(len(metas), np.float64)
    for i, m in enumerate(metas):
        info = json.loads(m.info_json or "{}")
        if INFO_KEY not in info:
            raise ModelError(f"sample {m.sample_id} has no {INFO_KEY}: its rollout worker ran without algo.distill")
        out[i] = coef * float(info[INFO_KEY])
    return out


def distill_loss(logprobs: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor,
                 coef: float) -> tuple[torch.Tensor, float]:
    """(coef x sum of weight x k2 over loss tokens, with gradient; the summed k1 reverse KL, a statistic).

    logprobs (with gradient), teacher, mask: [B, T]; weights [B] (the per-token weight of each row)."""
    m = mask.float()
    d = logprobs - teacher.float()
    tw = weights.float().unsqueeze(-1) * m
    return coef * (0.5 * d * d * tw).sum(), float((d.detach() * m).sum())


def padded_field(rows: Sequence[dict[str, np.ndarray]], window: tuple[int, int], name: str) -> torch.Tensor:
    """A float token field of padded rows as `workers.batches.local_batch` lays loss tensors out:
    [B, n] of positions [a+1, a+n+1) of each row as pulled, zero-padded."""
    _, n = window
    out = torch.zeros(len(rows), n + 1, dtype=torch.float32)
    for i, r in enumerate(rows):
        v = r[name]
        out[i, : len(v)] = torch.from_numpy(v.astype(np.float32))
    return out[:, 1:]
