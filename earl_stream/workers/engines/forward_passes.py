"""The built-in engine's two forward passes over a batch: the prefill that admits rows and the decode step.

It owns running them through the fast decoder (`fast_decoder`, a `StaticKV` cache) or the Hugging Face forward
(a `DynamicCache`), whichever `decode_path` chose, and recording the routed experts of MoE models. It leaves the
scheduling, sampling and the KV budget to `torch_engine` and the batch layout to `running`. A prefill longer than
`chunk_tokens` positions runs in chunks (`chunked_prefill`), on the fast decoder and on an HF forward whose
layers are all full attention; a model recording MoE routing (`routing`) prefills whole (its recorder files one
forward per prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from earl_stream.errors import EngineError
from earl_stream.workers.engines.chunked_prefill import chunk_bounds, fast_chunks, hf_can_chunk, hf_chunks
from earl_stream.workers.engines.fast_decoder import FastDecoder
from earl_stream.workers.engines.routing import RoutingRecorder
from earl_stream.workers.engines.running import Row, RunningBatch, fill_kept, merged_kept, prefill_layout, select_rows
from earl_stream.workers.engines.static_kv import StaticKV
from earl_stream.workers.engines.vision import rope_prefill, takes_3d_positions, vision_inputs


@dataclass(frozen=True)
class ForwardPasses:
    """What the passes run on: the HF `model`, its `fast` decoder (None: the HF forward), the `device` of its
    parameters, the MoE `routing` recorder (None for dense models), the `pad_id` of prompt padding, and whether
    rows admitted together with the same prompt share one prefill (`sharing`); `chunk_tokens`: the most prompt
    positions one prefill forward runs (`chunked_prefill.chunk_bounds`; 0: no chunks)."""

    model: PreTrainedModel
    fast: FastDecoder | None
    device: torch.device
    routing: RoutingRecorder | None
    pad_id: int
    sharing: bool
    chunk_tokens: int = 0

    def prefill(self, rows: list[Row], version: int, counts: dict[str, int]) -> RunningBatch:
        """One forward over the new prompt tokens of the admitted rows, laid out by `prefill_layout`: each
        distinct prompt once, its KV and logits then copied to every row that shares it. Logits are stamped with
        `version`; `counts`: the engine's counters, incremented here."""
        lay = prefill_layout(rows, self.sharing, self.pad_id)
        sources, index, cached, width_c, width_n = lay.sources, lay.index, lay.cached, lay.width_c, lay.width_n
        positions, shift = lay.positions, torch.zeros(len(lay.sources), dtype=torch.long)
        if takes_3d_positions(self.model):  # Qwen2-VL: 3-D positions, and each row's shift from its images
            positions, shift = rope_prefill(self.model, [r.req.images for r in lay.sources],
                                            [len(r.prompt) for r in lay.sources], positions)
        ids, mask, positions = lay.ids.to(self.device), lay.mask.to(self.device), positions.to(self.device)
        shift = shift.to(mask.device)
        cache: DynamicCache | StaticKV | None
        chunks = self.chunk_tokens if self.routing is None and not lay.images and \
            (self.fast is not None or hf_can_chunk(self.model)) else 0  # an image's tokens run in one forward
        invariant = self.fast is not None and self.fast.batch_invariant
        bounds = chunk_bounds(width_n, len(sources), chunks, rows_share=not invariant)
        if self.fast is not None:
            if lay.images:
                raise EngineError("the fast decoder was chosen for a model with images; vision models take the HF forward")
            capacity = width_c + width_n + max(r.remaining for r in rows)
            cache = self.fast.new_cache(len(sources), capacity)
            fill_kept(sources, cached, width_c, [(layer.k_buf, layer.v_buf) for layer in cache.layers])
            cache.length = width_c
            logits = fast_chunks(self.fast, ids, positions, mask, cache, bounds)
        else:
            cache = merged_kept(sources, cached, width_c)
            vision = vision_inputs(self.model, lay.images, self.device) if lay.images else {}
            logits, cache = hf_chunks(self.model, ids, positions, mask, cache, bounds, vision)
        assert cache is not None
        if self.routing is not None:
            self.routing.prefill(rows, lay)
        counts["forward_calls"] += len(bounds)
        counts["prefill_tokens"] += sum(len(r.prompt) - c for r, c in zip(sources, cached))
        counts["reused_tokens"] += sum(cached)
        for row in rows:
            row.kept = None  # its tensors now live in the batch cache
            row.logits_version = version
        if len(sources) < len(rows):
            counts["shared_prefix_tokens"] += sum(len(r.prompt) for r in rows) - sum(len(r.prompt) for r in sources)
            idx = torch.tensor(index, dtype=torch.long, device=mask.device)
            select_rows(cache, idx)
            logits, mask, shift = logits[idx], mask[idx], shift[idx]
        return RunningBatch(rows, cache, mask, mask.sum(-1) + shift, logits.float())

    def decode(self, batch: RunningBatch, tokens: torch.Tensor, version: int, counts: dict[str, int]) -> None:
        """Feed every row its last sampled token (tokens [B] int64): one forward, next-token logits into the batch."""
        batch.trim()
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        ids, positions = tokens[:, None].to(self.device), batch.positions[:, None]
        if isinstance(batch.cache, StaticKV):
            assert self.fast is not None
            logits = self.fast.forward(ids, positions, batch.mask, batch.cache)
        else:
            out = self.model(input_ids=ids, attention_mask=batch.mask, position_ids=positions,
                              past_key_values=batch.cache, use_cache=True)
            logits = out.logits[:, -1, :]
        if self.routing is not None:
            self.routing.decode(batch.rows)
        batch.logits = logits.float()
        batch.positions = batch.positions + 1
        for row in batch.rows:
            row.logits_version = version
        counts["forward_calls"] += 1
