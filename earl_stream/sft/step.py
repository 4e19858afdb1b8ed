"""One supervised step of one trainer rank under any plan of the trainer pool.

The rows of the step (tokenized transcripts, `sft.data.Example`) are known to every rank, so nothing
is pulled: each rank computes the same `store.layout.partition` as an RL step, takes its own rows and
micro-batches, builds its packed slice with `workers.batches.packed_local_batch` (rows concatenated,
attention per row, sp slices), and runs the forward with the pool's vocab-parallel log-probs. The loss
is the cross-entropy of the next token, weighted per token so that the step's loss is

    mean over assistant tokens of the step  +  context_weight x mean over the other tokens,

the means taken with the step's global counts, so the loss and its gradient do not depend on how the
step was split over data ranks, sequence slices or micro-batches (gradients are summed across ranks,
as in `workers.train_step`). The training loop around it is `sft.loop`.

A vision-language model's examples carry their images (`Example.images`): the forward merges each micro-batch's
pictures as the RL trainer's does (`workers.vision_inputs.VisionInputs`, every image with its span's ids, so a
sequence slice that cuts a picture still places its own part), and an image's placeholder tokens are no labels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from earl_stream.sft.data import Example
from earl_stream.store.layout import partition
from earl_stream.workers.batches import dummy_batch, packed_local_batch, rank_windows
from earl_stream.workers.mesh import Placement, clip_gradients, reduce_gradients
from earl_stream.workers.packed_attention import packed_segments
from earl_stream.workers.vision_inputs import BatchImage, RowImages, VisionInputs, place_images
from earl_stream.workers.vocab_parallel import forward_logprobs

__all__ = ["SFTStepResult", "sft_step", "step_weights"]


@dataclasses.dataclass(frozen=True)
class SFTStepResult:
    """loss: mean cross-entropy (nats) over the step's assistant tokens; context_loss: over its other
    tokens (the part of the loss weighted by `context_weight`); grad_norm before clipping."""

    loss: float
    context_loss: float
    grad_norm: float
    examples: int
    tokens: int
    loss_tokens: int
    step_seconds: float


def step_weights(examples: Sequence[Example], context_weight: float) -> tuple[float, float]:
    """(weight of one assistant token, weight of one other label token) for the whole step."""
    own = sum(e.loss_tokens for e in examples)
    other = sum(max(0, e.num_tokens - 1 - e.loss_tokens) for e in examples)  # token 0 is never a label
    return 1.0 / max(1, own), (context_weight / max(1, other) if context_weight else 0.0)


def _config(model: torch.nn.Module) -> Any:
    return model.config


def _row(e: Example) -> dict[str, np.ndarray]:
    context = (1 - e.loss_mask).astype(np.uint8)
    for img in e.images:  # a picture's tokens are the processor's placeholders: nothing to predict
        context[img.start: img.start + img.tokens] = 0
    return {"input_ids": e.input_ids, "loss_mask": e.loss_mask, "context_mask": context}


def _images(examples: Sequence[Example], mb: Sequence[int], window: tuple[int, int],
            lengths: Sequence[int]) -> list[BatchImage]:
    """The pictures of packed micro-batch `mb` placed in this rank's `window` (each with its span's ids)."""
    rows: RowImages = {i: [(img, examples[i].input_ids[img.start: img.start + img.tokens]) for img in examples[i].images]
                       for i in mb if examples[i].images}
    return place_images(mb, window[0], list(mb), rows, lengths) if rows else []


def _micro_batches(examples: Sequence[Example], placement: Placement, micro_batch_tokens: int) -> list[dict[str, Any]]:
    """This rank's packed micro-batches of the step (lockstep plans: as many as any data rank has,
    padded with zero-weight dummies so that every collective meets all its ranks)."""
    layout = placement.layout
    lengths = [e.num_tokens for e in examples]
    part = partition(lengths, layout, micro_batch_tokens=micro_batch_tokens, packed=True)
    windows, _ = rank_windows(part.micro_batches, lengths, layout.cp_size, layout.cp_rank, packed=True)
    passes = part.max_micro_batches if placement.lockstep else len(part.micro_batches)
    out = []
    for k in range(passes):
        if k >= len(part.micro_batches):
            batch: dict[str, Any] = dict(dummy_batch(layout.cp_rank))
            batch["context_mask"] = torch.zeros_like(batch["loss_mask"])
            out.append(batch)
            continue
        mb = part.micro_batches[k]
        batch = packed_local_batch([_row(examples[i]) for i in mb], [lengths[i] for i in mb], windows[k],
                                   layout.cp_size)
        batch["images"] = _images(examples, mb, windows[k], lengths)
        out.append(batch)
    return out


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, examples: Sequence[Example],
             placement: Placement, *, micro_batch_tokens: int = 8192, context_weight: float = 0.0,
             grad_clip: float = 1.0, vision: VisionInputs | None = None) -> SFTStepResult:
    """One optimizer step on `examples` (the same list on every rank of the pool); returns the step's
    losses (every rank gets the same). `vision`: a vision-language model's image inputs (required when an
    example has images)."""
    if vision is None and any(e.images for e in examples):
        raise ValueError("examples with images need the model's VisionInputs (vision=...)")
    start = time.monotonic()
    w_own, w_ctx = step_weights(examples, context_weight)
    sums = torch.zeros(2, dtype=torch.float64)
    group = placement.tp_group
    vocab_start = placement.vocab_start(int(_config(model).get_text_config().vocab_size))
    dtype = placement.autocast_dtype
    for batch in _micro_batches(examples, placement, micro_batch_tokens):
        dev = {k: v.to(placement.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        pictures = batch.get("images") or []
        merged = vision.merged(model, pictures) if vision is not None and pictures else contextlib.nullcontext()
        with packed_segments([model], batch.get("segments")), merged:
            with torch.autocast(placement.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                _, logp = forward_logprobs(model, dev, group=group, vocab_start=vocab_start)
            own, ctx = dev["loss_mask"].float(), dev["context_mask"].float()
            if "token_rows" in dev:  # packed: a position scores a label only inside its own row
                valid = (dev["token_rows"] >= 0).float()[None]
                own, ctx = own * valid, ctx * valid
            nll = -logp.float()
            loss = (nll * (own * w_own + ctx * w_ctx)).sum()
            loss.backward()
        with torch.no_grad():
            sums += torch.stack([(nll * own).sum() * w_own, (nll * ctx).sum()]).double().cpu()
    reduce_gradients(model, placement)
    norm = clip_gradients(model, grad_clip, placement)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if placement.world > 1:
        dist.all_reduce(sums)
        sums /= placement.plan.tp  # a tp group's ranks computed the same sums
    other = sum(max(0, e.num_tokens - 1 - e.loss_tokens) for e in examples)
    return SFTStepResult(loss=float(sums[0]), context_loss=float(sums[1]) / max(1, other), grad_norm=float(norm),
                         examples=len(examples), tokens=sum(e.num_tokens for e in examples),
                         loss_tokens=sum(e.loss_tokens for e in examples), step_seconds=time.monotonic() - start)
