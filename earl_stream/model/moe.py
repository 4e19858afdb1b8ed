"""Mixture-of-experts models: which modules route tokens, and the hooks that record or replay their choices.

Owns `routers` (the router modules of a loaded model, in layer order; what a model's routing is, from
its config, is `model.moe_config`'s) and `RouterHooks`: forward hooks on every router that record the
experts each forward chose ([N, top_k] per MoE layer) and, given recorded choices, replay them
(R3, rollout routing replay): the choice becomes the recorded indices while the gate's scores stay
the softmax of the router's own logits taken at those indices (renormalised as the model does), so
the router still gets gradients. Routers are the `gate` of the Hugging Face Qwen3-MoE and Mixtral
sparse blocks (and any module shaped like them: `top_k`, `num_experts`, a `weight` [experts, hidden],
a forward returning (logits, scores, indices)). Where choices are recorded (the engine,
`workers.engines.routing`) and replayed (the trainer, `workers.routing_replay`) is theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from earl_stream.model.moe_config import MOE_TYPES, RoutingSpec, moe_layers, not_recorded, num_experts, routing_spec

__all__ = ["MOE_TYPES", "RouterHooks", "RoutingSpec", "moe_layers", "not_recorded", "num_experts", "routers",
           "routing_spec"]

def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of `model`, in forward (layer) order."""
    out = []
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "top_k") and hasattr(module, "num_experts") and isinstance(weight, torch.Tensor)
                and weight.dim() == 2 and weight.shape[0] == module.num_experts):
            out.append(module)
    return out


class RouterHooks:
    """Forward hooks on a model's routers (registered once; idle unless told to record or replay).

    `record()`: the next forwards append each router's chosen indices [N, k] int64 to `recorded`, in
    call order (one forward of an L-layer MoE adds L). `replay(choices, apply)`: `choices[l]` [N, k]
    int64 is what MoE layer l of the next forward(s) must choose (a negative index: not recorded, the
    router's own choice stands); each router call compares its own choice with it (`disagreements` /
    `choices`, counted once per layer until the next `replay`) and, with `apply`, uses it.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self.recording = False
        self.recorded: list[torch.Tensor] = []
        self._replay: Sequence[torch.Tensor] | None = None
        self._apply = False
        self._counted: set[int] = set()
        self.disagreements = 0
        self.choices = 0
        self._handles = [r.register_forward_hook(self._hook_for(i)) for i, r in enumerate(self.routers)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def record(self) -> None:
        self.recording, self.recorded = True, []

    def replay(self, choices: Sequence[torch.Tensor] | None, apply: bool) -> None:
        """Set (or, with None, clear) the choices the next forwards compare with and, with `apply`, use."""
        if choices is not None and len(choices) != len(self.routers):
            raise ValueError(f"{len(choices)} layers of recorded routing for a model with {len(self.routers)} routers")
        self._replay, self._apply, self._counted = choices, apply, set()

    def _hook_for(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            logits, scores, own = output
            if self.recording:
                self.recorded.append(own.detach())
            if self._replay is None:
                return None
            rec = self._replay[layer].to(own.device)
            if rec.shape != own.shape:
                raise ValueError(f"router {layer}: recorded routing {tuple(rec.shape)} for {tuple(own.shape)} choices")
            valid = (rec >= 0).all(-1)
            if layer not in self._counted:
                self._counted.add(layer)
                hit = (rec[:, :, None] == own[:, None, :]).any(-1)
                self.disagreements += int((~hit & valid[:, None]).sum())
                self.choices += int(valid.sum()) * rec.shape[1]
            if not self._apply:
                return None
            chosen = torch.where(valid[:, None], rec, own)
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen3-MoE per config
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), chosen
        return hook
