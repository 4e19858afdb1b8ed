"""LoRA versions in the built-in engine, applied unmerged: the base weights never change, and each adapted linear
adds its adapter's low-rank product in the forward (y = W x + B (A x), alpha / r already folded into B on the wire,
see `earl_stream.model.lora`). A new version costs its adapter's bytes and a pointer swap, not a merge of B @ A
into every adapted weight (the merge was 91% of a LoRA version's sync time on SmolLM2-135M).

It owns `LowRank` (one adapted linear's A and B in the engine's dtype and device, and the update they add),
`fuse_low_rank` (the adapters of projections the fast decoder runs as one matmul, q/k/v and gate/up, as one
low-rank update: A stacked, B block-diagonal) and `LiveAdapters` (the engine's current version: the checks of a
version before anything changes, the swap, and forward hooks on the adapted `nn.Linear` modules so that the
Hugging Face forward adds the update too). The fast decoder asks `LiveAdapters.of(module)` for each of its
projections (`fast_decoder.FastDecoder.set_adapters`); the swap's timing and what running rows do is
`weight_swap`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from earl_stream.errors import EngineError
from earl_stream.model.lora import adapted_modules, adapter_problems

_A, _B = ".lora_A.weight", ".lora_B.weight"
Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class LowRank:
    """One adapted linear's update: a [r, in] and b [out, r] (the scaling folded into b), so that the layer
    computes W x + b (a x)."""

    a: torch.Tensor
    b: torch.Tensor

    def update(self, x: torch.Tensor, linear: Linear = F.linear) -> torch.Tensor:
        """b (a x) for x [..., in] -> [..., out], through `linear` (F.linear, or a batch-invariant one)."""
        return linear(linear(x, self.a, None), self.b, None)


def fuse_low_rank(parts: Sequence[tuple[LowRank | None, int]]) -> LowRank | None:
    """The update of projections run as one matmul over the same input (their outputs concatenated in `parts`'
    order; each given with its output size): A stacked [sum r, in], B block-diagonal [sum out, sum r] with zero
    rows where a projection has no adapter. None when none has one; a single one as it is."""
    present = [p for p, _ in parts if p is not None]
    if not present:
        return None
    if len(parts) == 1:
        return present[0]
    first = present[0].b
    b = first.new_zeros((sum(out for _, out in parts), sum(p.a.shape[0] for p in present)))
    row = col = 0
    for part, out in parts:
        if part is not None:
            r = part.a.shape[0]
            b[row : row + out, col : col + r] = part.b
            col += r
        row += out
    return LowRank(torch.cat([p.a for p in present]), b)


class LiveAdapters:
    """The LoRA version a built-in engine runs with (none before the first): see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._names = {id(m): n for n, m in model.named_modules()}
        # what an adapter may adapt: the model's linears, by weight name and shape (they never change shape)
        self._shapes = {f"{n}.weight": tuple(m.weight.shape) for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)}
        self._hooked: set[str] = set()
        self.current: dict[str, LowRank] = {}
        param = next(model.parameters())
        self._dtype, self._device = param.dtype, param.device

    def checked(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (a version's adapter on the wire) in the engine's dtype and device; EngineError, nothing
        changed, when it does not fit the model's linears or holds a non-finite value."""
        problems = adapter_problems(state, self._shapes)
        problems += [f"{k} holds non-finite values (NaN or inf)" for k, v in state.items()
                     if not bool(torch.isfinite(v).all())]
        if problems:
            raise EngineError("adapter rejected, nothing was loaded: " + "; ".join(problems[:8]))
        return {k: v.to(self._device, self._dtype) for k, v in state.items()}

    def install(self, state: Mapping[str, torch.Tensor]) -> None:
        """Run with the adapter `state` (from `checked`) from the next forward on: the previous version's
        adapter is dropped, the base weights are not touched."""
        adapters = {m: LowRank(state[m + _A], state[m + _B]) for m in adapted_modules(state)}
        modules = dict(self._model.named_modules())
        for name in adapters.keys() - self._hooked:
            modules[name].register_forward_hook(self._hook(name))
            self._hooked.add(name)
        self.current = adapters

    def clear(self) -> None:
        """Run without an adapter (a full version was loaded)."""
        self.current = {}

    def of(self, module: torch.nn.Module) -> LowRank | None:
        """The current adapter of `module` (a linear of the model), None if it has none."""
        return self.current.get(self._names.get(id(module), ""))

    @property
    def nbytes(self) -> int:
        """Bytes of the current adapter."""
        return sum(t.numel() * t.element_size() for p in self.current.values() for t in (p.a, p.b))

    def _hook(self, name: str) -> Callable[[torch.nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor]:
        """A forward hook adding `name`'s current update to its output (the HF forward, and any module the fast
        decoder runs through its own forward, e.g. a sparse expert block)."""

        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            pair = self.current.get(name)
            return output if pair is None else output + pair.update(args[0])

        return hook
