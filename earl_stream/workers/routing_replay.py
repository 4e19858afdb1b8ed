"""Rollout routing replay (R3) in the trainer: MoE layers route each token to the experts the engine chose.

Owns `RoutingReplay`, one per trainer model: which samples' `routed_experts` a step pulls (`fields`),
taking them out of the pulled rows (`split`: the batch builders know only [T] fields), laying them
out like each micro-batch's input ids (`add_to_batches`: padded [B, n] or packed [1, n], each position
[L, k] experts, -1 where nothing was recorded), and the router hooks around each micro-batch's forward
and backward (`around`). With `algo.routing_replay=rollout` the routers use the recorded experts (their
gate weights stay the softmax of their own logits at those experts: `model.moe.RouterHooks`), so the
old log-probs and the loss see the routing the behaviour log-probs were sampled with; with `none`
they route on their own. Either way each rank counts how often its own router disagrees with the
rollout's (`take_mismatch`; the `earl_trainer_routing_mismatch` gauge). How the step runs is
`train_step`'s.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from earl_stream.model.moe import RouterHooks, RoutingSpec, not_recorded, routing_spec
from earl_stream.records import ROUTED_EXPERTS, routing_info
from earl_stream.store.schema import SampleMeta

_BY_MODEL: weakref.WeakKeyDictionary[torch.nn.Module, RoutingReplay] = weakref.WeakKeyDictionary()


class RoutingReplay:
    """The routing replay of one trainer model (MoE); `of` gives None for a dense model."""

    def __init__(self, model: torch.nn.Module, spec: RoutingSpec) -> None:
        self.spec = spec
        self.hooks = RouterHooks(model)
        self.apply = False

    @classmethod
    def of(cls, model: torch.nn.Module, mode: str) -> RoutingReplay | None:
        """This model's replay (hooks registered once per model), set to `mode` (none | rollout)."""
        replay = _BY_MODEL.get(model)
        if replay is None:
            spec = routing_spec(model)
            if spec is None:
                return None
            replay = _BY_MODEL[model] = cls(model, spec)
        replay.apply = mode == "rollout"
        return replay

    def fields(self, metas: Sequence[SampleMeta]) -> tuple[str, ...]:
        """(ROUTED_EXPERTS,) when every claimed sample carries this model's routing, else ()."""
        want = (self.spec.dtype, self.spec.width)
        for m in metas:
            found = routing_info(json.loads(m.info_json))
            if found is None or found[:2] != want:
                return ()
        return (ROUTED_EXPERTS,)

    def split(self, pulled: dict[int, dict[str, np.ndarray]]) -> dict[int, torch.Tensor]:
        """Take routed_experts out of the pulled rows: claim row -> [T, L, k] int64 (-1: not recorded)."""
        out = {}
        for i, row in pulled.items():
            arr = row.pop(ROUTED_EXPERTS, None)
            if arr is not None:
                choices = torch.from_numpy(arr.reshape(-1, self.spec.layers, self.spec.top_k).astype(np.int64))
                out[i] = torch.where(choices == not_recorded(arr.dtype), -1, choices)
        return out

    def add_to_batches(self, batches: Mapping[tuple[int, int], dict[str, Any]], minis: Sequence[Any],
                       routed: Mapping[int, torch.Tensor], lengths: Sequence[int]) -> None:
        """Set each micro-batch's `routed_experts` [B, n, L, k] (padded) or [1, n, L, k] (packed), aligned
        with its input_ids (window (a, n)); none on a dummy micro-batch or when no row has routing."""
        if not routed:
            return
        for (u, k), batch in batches.items():
            mini = minis[u]
            if k >= len(mini.micro_batches) or not batch["rows"]:
                continue
            a, n = mini.windows[k]
            mb = mini.micro_batches[k]
            if mini.packed:
                parts = [routed[i] if i in routed else torch.full((lengths[i], *self._tail()), -1) for i in mb]
                batch[ROUTED_EXPERTS] = self._window(torch.cat(parts), a, n)[None]
            else:
                empty = torch.full((0, *self._tail()), -1, dtype=torch.int64)
                batch[ROUTED_EXPERTS] = torch.stack([self._window(routed.get(i, empty), a, n) for i in batch["rows"]])

    def _tail(self) -> tuple[int, int]:
        return self.spec.layers, self.spec.top_k

    def _window(self, choices: torch.Tensor, a: int, n: int) -> torch.Tensor:
        out = torch.full((n, *self._tail()), -1, dtype=torch.int64)
        part = choices[a: a + n]
        out[: len(part)] = part
        return out

    @contextlib.contextmanager
    def around(self, inner: contextlib.AbstractContextManager[Any], batch: Mapping[str, Any]) -> Iterator[None]:
        """`inner`, with the routers comparing with (and under `rollout`, using) the batch's recorded
        routing for the forwards and backward inside (recomputation included)."""
        choices = batch.get(ROUTED_EXPERTS)
        per_layer = None if choices is None else [choices[:, :, j].reshape(-1, self.spec.top_k)
                                                  for j in range(self.spec.layers)]
        with inner:
            self.hooks.replay(per_layer, self.apply)
            try:
                yield
            finally:
                self.hooks.replay(None, False)

    def take_mismatch(self) -> float:
        """Fraction of recorded (token, layer, expert) choices the trainer's own router did not make, since
        the last call (0 when none was compared)."""
        h = self.hooks
        out = h.disagreements / h.choices if h.choices else 0.0
        h.disagreements = h.choices = 0
        return out
