"""Recording, in the built-in engine, the experts each MoE layer routed every fed token to.

Owns `RoutingRecorder` (router hooks, `model.moe.RouterHooks`, in record mode on the engine's model;
after each prefill or decode forward it files the choices [tokens, layers, top_k] under the rows
they belong to, by position) and the per-episode assembly (`merge_routing`, `episode_routing`): a
request's result carries `routed_experts` [prompt + generated, layers, top_k] with "not recorded"
where the engine did not feed the token in that request (positions whose KV was kept from an earlier
turn; the last sampled token); an episode keeps, per position, the first turn that recorded it (the
choice its later tokens' log-probs were computed with). The scheduler is `torch_engine`'s; what the
record holds is `records.ROUTED_EXPERTS`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from earl_stream.model.moe import RouterHooks, RoutingSpec, not_recorded, routing_spec

if TYPE_CHECKING:
    from earl_stream.workers.engines.running import PrefillLayout, Row

_LOG = logging.getLogger(__name__)


class RoutingRecorder:
    """Records the routing of every token the engine feeds; one per engine (its lock serialises forwards)."""

    def __init__(self, model: torch.nn.Module, spec: RoutingSpec) -> None:
        self.spec = spec
        self._hooks = RouterHooks(model)
        if len(self._hooks.routers) != spec.layers:
            raise ValueError(f"model config names {spec.layers} MoE layers, found {len(self._hooks.routers)} routers")
        self._hooks.record()

    @classmethod
    def attach(cls, model: torch.nn.Module) -> RoutingRecorder | None:
        """A recorder for an MoE model (logged), None for a dense one."""
        spec = routing_spec(model)
        if spec is None:
            return None
        _LOG.info("MoE model (%d layers x top-%d of %d experts): recording routed experts per token",
                  spec.layers, spec.top_k, spec.experts)
        return cls(model, spec)

    def _take(self) -> np.ndarray:
        """The last forward's choices [tokens, layers, top_k] in the record's dtype."""
        rec = self._hooks.recorded[-self.spec.layers:]
        self._hooks.recorded = []
        return torch.stack(rec, dim=1).to(torch.int16).cpu().numpy().astype(self.spec.dtype)

    def prefill(self, rows: list[Row], lay: PrefillLayout) -> None:
        """File a prefill's choices: source j ran its prompt's positions [cached[j], len(prompt)),
        right-aligned in its [width_n] ids; every admitted row gets its source's."""
        arr = self._take().reshape(len(lay.sources), lay.width_n, self.spec.layers, self.spec.top_k)
        for row, j in zip(rows, lay.index):
            src, start = lay.sources[j], lay.cached[j]
            row.routing.append((start, arr[j, lay.width_n - (len(src.prompt) - start):]))

    def decode(self, rows: list[Row]) -> None:
        """File a decode step's choices: row j fed its last sampled token."""
        arr = self._take()
        for j, row in enumerate(rows):
            row.routing.append((len(row.prompt) + len(row.tokens) - 1, arr[j: j + 1]))

    def result(self, row: Row) -> np.ndarray:
        """[len(prompt) + len(tokens), layers, top_k] of a finished row ("not recorded" where it fed nothing)."""
        out = np.full((len(row.prompt) + len(row.tokens), self.spec.layers, self.spec.top_k),
                      not_recorded(self.spec.dtype), self.spec.dtype)
        for start, part in row.routing:
            out[start: start + len(part)] = part
        row.routing.clear()
        return out


def merge_routing(episode: np.ndarray | None, turn: np.ndarray | None) -> np.ndarray | None:
    """An episode's routing [T, L, k] after a turn whose result routing covers [T', L, k]: positions the
    episode has recorded keep their choice, the others take the turn's (a dense model: None)."""
    if turn is None:
        return episode
    if episode is None:
        return turn.copy()
    out = np.full((max(len(episode), len(turn)),) + turn.shape[1:], not_recorded(turn.dtype), turn.dtype)
    out[: len(turn)] = turn
    n = min(len(episode), len(out))
    known = (episode[:n] != not_recorded(episode.dtype)).all(axis=(1, 2))
    out[:n][known] = episode[:n][known]
    return out


def episode_routing(routing: np.ndarray | None, length: int) -> np.ndarray | None:
    """The record's routed_experts [length, L, k]: cut or padded with "not recorded"."""
    if routing is None:
        return None
    out = np.full((length,) + routing.shape[1:], not_recorded(routing.dtype), routing.dtype)
    n = min(length, len(routing))
    out[:n] = routing[:n]
    return out
