"""Which parts of a Hugging Face causal LM the trainer lays out, and how, for any dense decoder family.

Owns `decoder_layers` (the blocks FSDP2 shards one by one: the model's `_no_split_modules` classes),
`tp_plan` (the tensor-parallel plan, derived from the model's own `config.base_model_tp_plan`) and
`family_problems` (why a model's family cannot run a tp / sp / packed plan, from its config alone,
so the supervisor and `mesh.RankPlan.problems` can refuse a plan before any rank lays anything out).
Applying a plan (DTensor `parallelize_module`, FSDP2) is `workers.sharding`'s job.

Tensor parallel follows transformers' own plan styles, each mapped to a DTensor parallel style that
keeps the single-process math exactly: `colwise` / `rowwise` (Megatron: outputs / inputs sharded),
`colwise_gather_output` / `rowwise_split_input` (Phi-3's fused qkv and gate_up, OLMo 2's q/k/v whose
norms span every head: the output is gathered, so what follows runs on every rank whole, and the
row-parallel layer after it takes its share of the input), `embedding_rowwise`, and
`replicated_with_grad_allreduce` (Qwen3's and Gemma 3's per-head q/k norms: weights replicated over tp,
their gradients summed over the tp ranks, whose heads differ). The embedding is row-parallel over
the vocabulary and the LM head column-parallel with its output left sharded
(`workers.vocab_parallel`) whatever the model's plan says about them. A style not listed, a plan
naming a module the model lacks, or no plan at all is refused with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from earl_stream.errors import ConfigError

__all__ = ["decoder_layers", "family_problems", "tp_plan"]


class HeadwiseReplicate(SequenceParallel):
    """transformers' `replicated_with_grad_allreduce`: a module (a per-head q/k norm) whose weights every
    tp rank holds whole while its input [..., heads/tp, head_dim] holds this rank's heads. Its
    parameters become DTensors replicated over tp and its input this rank's shard along the heads dim,
    so autograd sums the weight gradients of the tp ranks; its output is the local tensor again."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=-2, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding: Any, mod: Any, inputs: Any, device_mesh: Any) -> Any:
        x = inputs[0]
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(x, device_mesh, (Shard(x.dim() - 2),), run_check=False)


STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "replicated_with_grad_allreduce": HeadwiseReplicate,
}
_SHARDED = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input")  # split a Linear's weight


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a causal LM, in order: the modules of its `_no_split_modules` classes
    (Llama's `LlamaDecoderLayer`, Phi-3's `Phi3DecoderLayer`, ...); else the longest ModuleList of
    its base model. ConfigError when it has neither."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    base: Any = getattr(model, "base_model", model)
    lists = [list(m) for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigError(f"{type(model).__name__} names no decoder-layer class (_no_split_modules) and holds no "
                          "ModuleList of blocks: FSDP cannot shard it layer by layer")
    return max(lists, key=len)


def _base_prefix(model: torch.nn.Module) -> str:
    hf: Any = model
    base = getattr(hf, "base_model", model)
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


def _name_of(model: torch.nn.Module, target: torch.nn.Module | None) -> str | None:
    return next((name for name, m in model.named_modules() if m is target), None)


def _model_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def tp_plan(model: torch.nn.Module) -> dict[str, ParallelStyle]:
    """{module name: DTensor parallel style} for `parallelize_module` on the tp mesh, from the model's
    `config.base_model_tp_plan` (`layers.*.self_attn.q_proj` names relative to the base model, `*`
    over the decoder layers), plus the vocabulary-parallel embedding and LM head. ConfigError names
    the first thing the trainer cannot lay out."""
    hf: Any = model
    problems = family_problems(hf.config, tp=2)
    if problems:
        raise ConfigError("; ".join(problems))
    modules = dict(model.named_modules())
    prefix = _base_prefix(model)
    embed, head = _name_of(model, hf.get_input_embeddings()), _name_of(model, hf.get_output_embeddings())
    if embed is None or head is None:
        raise ConfigError(f"{type(model).__name__} has no input embedding or LM head to lay out over the vocabulary")
    plan: dict[str, ParallelStyle] = {
        embed: STYLES["embedding_rowwise"](),
        head: ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True),
    }
    for pattern, style in _model_plan(hf.config).items():
        regex = "\\.".join("[0-9]+" if part == "*" else re.escape(part) for part in (prefix + pattern).split("."))
        names = [n for n in modules if re.fullmatch(regex, n)]
        if not names:
            raise ConfigError(f"the model's tensor-parallel plan names {pattern!r}, which {type(model).__name__} "
                              "does not have")
        for name in names:
            if name in (embed, head):
                continue  # always vocabulary-parallel, whatever the model's plan says
            module = modules[name]
            if style in _SHARDED and not isinstance(module, torch.nn.Linear):
                raise ConfigError(f"{name} is a {type(module).__name__}, not a Linear: tp style {style!r} cannot "
                                  "split it")
            plan[name] = STYLES[style]()
    return plan


def family_problems(config: Any, *, tp: int = 1, sp: int = 1, packing: bool = False) -> list[str]:
    """Why a model with HF `config` cannot train under tensor parallel `tp`, Ulysses sequence parallel
    `sp` or with packed micro-batches (several rows in one sequence); [] when it can. From the config
    alone, so the supervisor can ask before any rank loads the model."""
    out: list[str] = []
    kind = getattr(config, "model_type", "?")
    if tp > 1 and getattr(config, "vision_config", None) is not None:
        return [f"tp={tp}: {kind} is a vision-language model, which the trainer lays out under dp / fsdp / sp only "
                "(its vision tower has no tensor-parallel plan)"]
    if tp > 1:
        plan = _model_plan(config)
        if not plan:
            out.append(f"tp={tp}: {kind} has no tensor-parallel plan (config.base_model_tp_plan); use dp / fsdp")
        unknown = sorted({s for s in plan.values() if s not in STYLES})
        if unknown:
            out.append(f"tp={tp}: {kind}'s tensor-parallel plan uses styles {unknown} that the trainer does not lay "
                       f"out (known: {', '.join(STYLES)}); use dp / fsdp")
    if sp > 1 or packing:
        what = f"sp={sp}" if sp > 1 else "packing"
        if not _attention_interface(config):
            out.append(f"{what}: {kind}'s attention does not go through transformers' attention interface "
                       "(ALL_ATTENTION_FUNCTIONS), so Ulysses and per-row packed attention cannot replace it")
        if getattr(config, "attn_logit_softcapping", None):
            out.append(f"{what}: {kind} soft-caps its attention logits (attn_logit_softcapping="
                       f"{config.attn_logit_softcapping}), which the trainer's packed and Ulysses attention do not")
        if getattr(config, "attention_chunk_size", None):
            out.append(f"{what}: {kind} uses chunked attention (attention_chunk_size), which the trainer's packed "
                       "and Ulysses attention do not")
    return out


def _attention_interface(config: Any) -> bool:
    """The causal-LM class of `config` runs its attention through `ALL_ATTENTION_FUNCTIONS` (transformers
    marks such classes `_supports_attention_backend`); True when the class is not known here."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""), None)
    if not isinstance(name, str):
        return True
    import transformers

    cls = getattr(transformers, name, None)
    return cls is None or bool(getattr(cls, "_supports_attention_backend", False))
