"""`earl-stream sft`'s knobs (`key=value` on its command line), apart from the loop so that the command line
builds its parser without importing torch."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from earl_stream.config.fields import field as _f

if TYPE_CHECKING:
    from earl_stream.workers.mesh import RankPlan


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning knobs (`earl-stream sft ... key=value`)."""

    lr: float = _f(1e-5, "peak learning rate (AdamW)", minimum=0)
    beta1: float = _f(0.9, "AdamW beta1", minimum=0)
    beta2: float = _f(0.999, "AdamW beta2", minimum=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", minimum=0)
    batch_size: int = _f(16, "transcripts per optimizer step", minimum=1)
    epochs: float = _f(1.0, "passes over the transcript file (when steps = 0)", minimum=0)
    steps: int = _f(0, "optimizer steps; 0 = epochs x transcripts / batch_size", minimum=0)
    seconds: float = _f(0.0, "wall-time budget; 0 = none (the first of steps and seconds ends the run)", minimum=0)
    warmup_steps: int = _f(0, "steps of linear warm-up", minimum=0)
    decay_fraction: float = _f(0.0, "the learning rate falls linearly to min_lr_ratio x lr over this last fraction "
                               "of the budget", minimum=0)
    min_lr_ratio: float = _f(0.1, "the final learning rate as a fraction of lr", minimum=0)
    context_weight: float = _f(0.0, "weight of the next-token loss on non-assistant tokens (0 = assistant tokens "
                               "only)", minimum=0)
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)", minimum=0)
    micro_batch_tokens: int = _f(8192, "tokens one rank packs into a micro-batch", minimum=1)
    dp: int = _f(1, "data-parallel replicas", minimum=1)
    fsdp: int = _f(1, "FSDP2 shards", minimum=1)
    tp: int = _f(1, "tensor-parallel degree", minimum=1)
    sp: int = _f(1, "sequence-parallel (Ulysses) degree", minimum=1)
    recompute: bool = _f(False, "activation recomputation")
    dtype: str = _f("fp32", "compute dtype", choices=("fp32", "bf16"))
    device: str = _f("auto", "cpu, cuda, or auto")
    seed: int = _f(0, "shuffling and initialisation seed")
    checkpoint_every: int = _f(0, "write a checkpoint every N steps (0 = only at the end)", minimum=0)
    log_every: int = _f(50, "log a line every N steps where no progress is shown (`earl-stream sft` shows it)",
                        minimum=1)

    @property
    def plan(self) -> RankPlan:
        from earl_stream.workers.mesh import RankPlan

        return RankPlan(dp=self.dp, fsdp=self.fsdp, tp=self.tp, sp=self.sp, micro_batch_tokens=self.micro_batch_tokens,
                        recompute=self.recompute, dtype=self.dtype)
