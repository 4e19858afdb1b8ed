"""The routing of a mixture-of-experts model, read from its config alone (no torch, no weights).

Owns `RoutingSpec` (the MoE layers, experts and top-k of a model, and the dtype of one recorded
choice), `routing_spec`, `moe_layers` and `num_experts`: what the supervisor's memory model, the
config checks and the record need to know about experts. The router modules and their hooks are
`model.moe`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

MOE_TYPES = frozenset({"qwen3_moe", "mixtral"})  # model types whose routers `routers` finds and hooks
_EXPERT_KEYS = ("num_experts", "num_local_experts")  # transformers 5 writes Qwen3-MoE's num_experts as the latter


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    """What one token's recorded routing holds: `top_k` expert indices for each of `layers` MoE layers.

    A recorded choice is uint8 when `experts` < 255 (255 = not recorded), else int16 (-1 = not recorded).
    """

    layers: int  # MoE layers (dense layers of a mixed model route nothing and record nothing)
    experts: int
    top_k: int

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8) if self.experts < 255 else np.dtype(np.int16)

    @property
    def width(self) -> int:
        """Elements per token: layers x top_k."""
        return self.layers * self.top_k

    def descriptor(self) -> dict[str, Any]:
        """The JSON a sample's metadata carries for its `routed_experts` field (records.ROUTED_EXPERTS)."""
        return {"layers": self.layers, "top_k": self.top_k, "experts": self.experts, "dtype": self.dtype.str}


def not_recorded(dtype: np.dtype) -> int:
    """The value of a choice that was not recorded (a position the engine never fed, or padding)."""
    return 255 if np.dtype(dtype) == np.uint8 else -1


def moe_layers(d: Mapping[str, Any]) -> list[int]:
    """Indices of the decoder layers with a sparse (routed) MLP, from a config dict; [] for a dense model."""
    if d.get("model_type") not in MOE_TYPES or not num_experts(d):
        return []
    n = int(d.get("num_hidden_layers") or 0)
    if d.get("model_type") == "qwen3_moe":
        dense, step = set(d.get("mlp_only_layers") or ()), int(d.get("decoder_sparse_step") or 1)
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return list(range(n))


def num_experts(d: Mapping[str, Any]) -> int:
    """Experts per MoE layer from a config dict (0 if it names none)."""
    return int(next((d[k] for k in _EXPERT_KEYS if d.get(k)), 0))


def routing_spec(model_or_config: Any) -> RoutingSpec | None:
    """The routing of a model (an `nn.Module` with `.config`), a `PretrainedConfig` or a config dict;
    None for a dense model or a family this module does not know."""
    config = getattr(model_or_config, "config", model_or_config)
    d = dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config)
    layers = moe_layers(d)
    if not layers:
        return None
    return RoutingSpec(layers=len(layers), experts=num_experts(d),
                       top_k=int(d.get("num_experts_per_tok") or 2))
