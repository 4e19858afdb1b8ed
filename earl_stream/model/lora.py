"""LoRA adapters on a frozen base: made with `peft`, trained by the trainer, moved alone, applied by engines.

Owns `apply_lora` (peft's `inject_adapter_in_model` on a Hugging Face causal LM, in place: the model
keeps its class and its `model.layers`, so the trainer's placements and re-shards lay it out like any
other; the base is frozen, only `lora_A` / `lora_B` train), `adapter_state` (what a policy version
publishes: the adapter tensors alone, under wire names), `adapter_problems` (whether a version fits a model)
and `merged_weights` (base + B @ A: vLLM's merge mode, export). The built-in engine applies a version
unmerged (`workers.engines.adapters`). Config checks are `model.lora_checks`'; checkpoints and
export of adapters are `model.lora_export`'s.

Wire format of a version's adapter (one per adapted linear layer `M`, e.g.
`model.layers.0.self_attn.q_proj`): `M.lora_A.weight` [r, in] and `M.lora_B.weight` [out, r] with
the scaling alpha / r already folded into B, so the update an engine adds to `M.weight` is B @ A
(nothing else about the run needs to travel). Under FSDP each rank publishes its own block of them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from earl_stream.errors import ModelError

log = logging.getLogger(__name__)

_ATTR = "earl_lora"  # the LoraSpec an adapted model carries (meta copies are adapted the same way)
_PEFT_ADAPTER = "default"
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The shape of the adapters of a run (`config.LoraConfig` without the switch)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora: Any) -> LoraSpec | None:
        """From `config.LoraConfig`; None when LoRA is off."""
        if not lora.enabled:
            return None
        return cls(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                   target_modules=tuple(lora.target_modules))

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules)}

    def differences(self, other: LoraSpec) -> list[str]:
        """What differs between two adapter shapes (rank and targets change tensor shapes and names)."""
        return [f"{k}: {getattr(self, k)!r} here, {getattr(other, k)!r} there" for k in ("rank", "target_modules")
                if getattr(self, k) != getattr(other, k)]

    def peft_config(self) -> Any:
        from peft import LoraConfig

        alpha: Any = self.alpha  # peft annotates an int; a fractional alpha works all the same
        return LoraConfig(r=self.rank, lora_alpha=alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, spec: LoraSpec, *, seed: int = 0) -> torch.nn.Module:
    """Add `spec`'s adapters to `model` in place (peft's default init: A random, B zero, so the
    adapted model starts equal to the base) and freeze everything else. Returns `model`.

    A is drawn from its own generator seeded with `seed` (the global RNG is left as it was), so every
    trainer rank of a pool starts from the same adapters."""
    from peft import inject_adapter_in_model

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(spec.peft_config(), model)
    except ValueError as exc:
        raise ModelError(f"model.lora.target_modules={list(spec.target_modules)}: {exc}") from None
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    setattr(model, _ATTR, spec)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info("LoRA rank %d (alpha %g) on %s: %d trainable parameters of %d", spec.rank, spec.alpha,
             ",".join(spec.target_modules), trainable, sum(p.numel() for p in model.parameters()))
    return model


def lora_spec(model: torch.nn.Module) -> LoraSpec | None:
    """The adapters `model` carries (None: a plain model)."""
    spec = getattr(model, _ATTR, None)
    return spec if isinstance(spec, LoraSpec) else None


def is_adapter_name(name: str) -> bool:
    """A parameter (or state dict key) of an adapter, in peft's names or on the wire."""
    return ".lora_A." in name or ".lora_B." in name


def wire_name(name: str) -> str:
    """peft's `M.lora_A.default.weight` -> the wire's `M.lora_A.weight`."""
    return name.replace(f".{_PEFT_ADAPTER}.", ".")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a LoRA policy version publishes, under wire names, B scaled by alpha / r (plain or
    DTensor, as the model holds them; nothing is gathered). Read from the parameters, not `state_dict()`, which
    builds an entry for every base tensor too (a third of a SmolLM2 LoRA version's sync time)."""
    spec = lora_spec(model)
    if spec is None:
        raise ModelError("adapter_state: the model has no LoRA adapters")
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not is_adapter_name(name):
            continue
        value = param.detach()
        out[wire_name(name)] = value * spec.scaling if name.endswith(f"lora_B.{_PEFT_ADAPTER}.weight") else value
    return out


def is_adapter_state(state: Mapping[str, torch.Tensor]) -> bool:
    """`state` is a LoRA version on the wire (adapter tensors only)."""
    return bool(state) and all(is_adapter_name(k) for k in state)


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the whole tensors of `state` (DTensors counted at their global size), a tensor that several
    names share (a tied LM head) once, as it is published (`store.weights.distinct_tensors`)."""
    from earl_stream.store.weights import distinct_tensors

    return sum(v.numel() * v.element_size() for v in distinct_tensors(state).values())


def adapter_problems(state: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why the adapter version `state` does not fit a model whose weights have `shapes` (by the model's names);
    [] when it does."""
    problems = [k for k in state if not k.endswith((_A, _B)) or k.replace(_B, _A) not in state]
    for module in adapted_modules(state):
        a, b, target = state[module + _A], state.get(module + _B), module + ".weight"
        if b is None or target not in shapes:
            problems.append(f"{module}: {'no lora_B' if b is None else 'the model has no ' + target}")
            continue
        base = tuple(shapes[target])
        if len(base) != 2 or tuple(b.shape) != (base[0], a.shape[0]) or a.shape[1] != base[1]:
            problems.append(f"{module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit {base}")
    return sorted(set(problems))


def adapted_modules(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The layers an adapter version adapts (`model.layers.0.self_attn.q_proj`, ...), sorted."""
    return sorted({k[: -len(_A)] for k in state if k.endswith(_A)})


def merged_weights(state: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """base weight + B @ A of each layer `state` adapts (fp32, cast back to the base's dtype), by the model's
    names; `state` must fit (`adapter_problems`). `base` is not changed."""
    out: dict[str, torch.Tensor] = {}
    for module in adapted_modules(state):
        a, b, weight = state[module + _A], state[module + _B], base[module + ".weight"]
        dev, f32 = weight.device, torch.float32
        out[module + ".weight"] = torch.addmm(weight.to(dev, f32), b.to(dev, f32), a.to(dev, f32)).to(weight.dtype)
    return out
