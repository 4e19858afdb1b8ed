"""Which layouts a trainer pool can run a model under, and why the others are refused.

Owns `pool_layouts`: the candidate layouts (tensor parallel x Ulysses sequence parallel x data
parallel, with and without FSDP, each recomputation mode) of a pool of N ranks for one design length,
and `Refusal`s for the tensor/sequence-parallel sizes the model or the pool cannot take. Whether a
layout fits memory is `memory_model`'s answer; which one is fastest `cost_model`'s; choosing is the
selector's.

The layouts are those the trainer's wire plan (`protocol.TrainerPlan`) can express: tp and sp are
powers of two, dp is the rest of the pool, and FSDP shards the states over the dp x sp ranks of a
layout with dp >= 2 (the plan's fsdp degree is that dp). FSDP over the sp ranks alone (dp = 1) is
not a trainer plan, so it is not a candidate.

Expert parallel (`allow_ep`, mixture-of-experts models, tp = sp = 1): ep is a power of two >= 2
dividing dp (ep ranks are data ranks) and the experts per layer; with FSDP only where dp / ep >= 2
(FSDP over the ep ranks alone is not a trainer plan: its fsdp degree is dp / ep). The ep degrees the
expert count does not divide are refused with the reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from earl_stream.supervisor.decisions import Refusal
from earl_stream.supervisor.memory_model import ModelShape, Recompute, TrainPlan


def pool_layouts(shape: ModelShape, base: TrainPlan, devices: int, design_seq_len: int, *,
                 recomputes: Sequence[Recompute], allow_tp: bool = True, allow_sp: bool = True,
                 allow_fsdp: bool = True, allow_ep: bool = False) -> tuple[list[TrainPlan], list[Refusal]]:
    """Every layout of `base` on exactly `devices` ranks for one `design_seq_len` sequence (micro_batch
    1) that the model and the pool can take, and the refused tp x sp sizes (up to `devices`) with why:
    heads not divisible by tp x sp; kv heads, vocabulary, intermediate or hidden size not divisible
    by tp (`ModelShape.layout_problems`); a pool that is not a multiple of tp x sp."""
    pow2 = [1 << i for i in range(devices.bit_length())]
    out, refused = [], []
    for tp in pow2 if allow_tp else [1]:
        for sp in pow2 if allow_sp else [1]:
            if tp * sp > devices:
                continue
            problems = shape.layout_problems(tp, sp)
            if tp > 1 and base.lora_params:
                problems.insert(0, "a LoRA run (model.lora) trains adapters the tensor-parallel plan does not "
                                   "shard with their layers, so tp is excluded for LoRA runs")
            if devices % (tp * sp):
                problems.insert(0, f"a pool of {devices} ranks is not a multiple of tp*sp={tp * sp}")
            if problems:
                name = "_".join(f"{k}{v}" for k, v in (("tp", tp), ("sp", sp)) if v > 1)
                refused.append(Refusal(name, "; ".join(problems)))
                continue
            if design_seq_len % sp:
                continue
            dp = devices // (tp * sp)
            eps = [1]
            if allow_ep and shape.is_moe and tp == sp == 1:
                eps += _ep_degrees(shape, dp, refused)
            for ep in eps:
                for fsdp in (False, True) if allow_fsdp and dp // ep > 1 else (False,):
                    for rc in recomputes:
                        out.append(dataclasses.replace(base, micro_batch=1, seq_len=design_seq_len, dp=dp, tp=tp, sp=sp,
                                                       fsdp=fsdp, recompute=rc, ep=ep,
                                                       sequence_parallel=base.sequence_parallel and tp > 1))
    return out, refused


def _ep_degrees(shape: ModelShape, dp: int, refused: list[Refusal]) -> list[int]:
    """The ep degrees (>= 2, powers of two dividing dp) the experts allow; the others refused."""
    out = []
    for ep in (1 << i for i in range(1, dp.bit_length()) if dp % (1 << i) == 0):
        if shape.num_experts % ep:
            refused.append(Refusal(f"ep{ep}", f"ep={ep} does not divide the {shape.num_experts} experts per layer"))
        else:
            out.append(ep)
    return out
