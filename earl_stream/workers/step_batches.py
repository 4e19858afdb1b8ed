"""A training step's share of its claim on this rank: which rows each optimizer update trains and how they are
cut into micro-batches (`plan_updates`), pulling them from their producers (`pull_claim`: a group whose
producer is gone is dropped whole), and each micro-batch's tensors (`micro_batch`), with the images of a
vision-language policy and the 3-D positions of a multimodal-RoPE decoder (`add_rope`).

Every rank computes the same plan from the claim's metadata (`earl_stream.store.layout.partition`), so no
rank needs to ask another which rows it runs; `workers.train_step` runs the micro-batches.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from earl_stream.algo import distill
from earl_stream.algo.losses import row_weights
from earl_stream.config import AlgoConfig
from earl_stream.errors import ConfigError
from earl_stream.records import images_info
from earl_stream.store.experience import Puller, SamplesUnavailable, pull_samples
from earl_stream.store.layout import Layout, partition
from earl_stream.store.schema import SampleMeta
from earl_stream.workers.batches import dummy_batch, local_batch, packed_local_batch, rank_windows
from earl_stream.workers.dynamic_sp import DynamicSp
from earl_stream.workers.mesh import Placement
from earl_stream.workers.vision_inputs import Described, RowImages, VisionInputs, place_images, place_spans, pull_row_images

FIELDS = ("input_ids", "loss_mask", "behaviour_logprobs")
VERSION = "policy_version"  # pulled only when a claimed sample holds a token older than the bound


@dataclasses.dataclass(frozen=True)
class Mini:
    """One optimizer update's share of the claim, as this rank runs it (claim row indices)."""

    rows: list[int]
    micro_batches: list[list[int]]
    windows: list[tuple[int, int]]
    ranges: dict[int, list[tuple[int, int]]] | None
    passes: int  # micro-batch passes this rank runs (lockstep plans: the most any data rank has)
    weights: dict[int, float]  # every row of the update (all ranks'): its per-token loss weight
    packed: bool = False  # micro-batches are packed sequences (windows from `packed_windows`)
    shared: int = 0  # the first `shared` micro-batches run on every data rank at sp `shared_sp` (dynamic sp)
    shared_sp: tuple[int, int] = (1, 0)  # (sp degree, this rank's sp rank) of the shared micro-batches

    def sp(self, k: int, layout: Layout) -> tuple[int, int]:
        """(sp degree, sp rank) of micro-batch k on this rank."""
        return self.shared_sp if k < self.shared else (layout.cp_size, layout.cp_rank)


def plan_updates(metas: Sequence[SampleMeta], layout: Layout, placement: Placement, micro_batch_tokens: int,
          algo: AlgoConfig, *, packed: bool = True, dynamic: DynamicSp | None = None) -> list[Mini]:
    """The step's updates: its groups, in prompt order, cut into `algo.mini_batches` contiguous parts,
    each partitioned over the pool like a claim of its own. (Prompt order, not claim order: a claim
    lists groups as they completed, which varies from run to run.) Under `dynamic` sp an update's rows
    longer than its threshold come first, one shared micro-batch each, the same on every rank."""
    groups = [g for _, g in sorted({(m.prompt_ordinal, m.group_id) for m in metas})]
    k = max(1, min(algo.mini_batches, len(groups)))
    parts = [set(groups[len(groups) * j // k: len(groups) * (j + 1) // k]) for j in range(k)]
    dynamic = dynamic or DynamicSp()
    out = []
    for part in parts:
        idx = [i for i, m in enumerate(metas) if m.group_id in part]
        lengths = [metas[i].total_tokens for i in idx]
        shared = dynamic.micro_batches(lengths, packed=packed)
        taken = set(shared.rows)
        own = [j for j in range(len(idx)) if j not in taken]  # positions in idx
        p = partition([lengths[j] for j in own], layout, micro_batch_tokens=micro_batch_tokens, packed=packed)
        mbs = [[own[j] for j in mb] for mb in p.micro_batches]
        windows, ranges = rank_windows(mbs, lengths, layout.cp_size, layout.cp_rank, packed=packed)
        if shared.rows:  # own rows whole (ranges None) or sliced (cp > 1); shared rows sliced
            ranges = {**(ranges or {}), **shared.ranges}
        weights = row_weights([metas[i].response_tokens for i in idx], algo.loss_agg)
        passes = p.max_micro_batches if placement.lockstep else len(p.micro_batches)
        out.append(Mini(rows=[idx[j] for j in shared.rows + [own[j] for j in p.rows]],
                         micro_batches=[[idx[j] for j in mb] for mb in shared.micro_batches + mbs],
                         windows=shared.windows + windows,
                         ranges=None if ranges is None else {idx[j]: r for j, r in ranges.items()},
                         passes=len(shared.micro_batches) + passes, weights=dict(zip(idx, weights)), packed=packed,
                         shared=len(shared.micro_batches), shared_sp=(dynamic.degree, dynamic.rank)))
    return out


def claim_images(metas: Sequence[SampleMeta], vision: VisionInputs | None) -> tuple[Described, int]:
    """Each claim row's images as its metadata records them (start, tokens, width, height; empty: the claim's
    images are not pulled), and the PNG bytes of all of them (what a rank that pulled every picture of the step
    would move). ConfigError when a sample showed one and the trainer's model takes no images."""
    infos = {i: d[0] for i, m in enumerate(metas) if (d := images_info(json.loads(m.info_json))) is not None}
    if infos and vision is None:
        raise ConfigError("the claimed samples showed images but the trainer's model is text-only: train a "
                          "vision-language model (Idefics3 / SmolVLM) on image environments")
    described: Described = {i: [(s[0], s[1], s[2], s[3]) for s in spans] for i, spans in infos.items()}
    return described, sum(span[4] for spans in infos.values() for span in spans)


def micro_batch(mini: Mini, k: int, pulled: dict[int, dict[str, np.ndarray]], layout: Layout, min_version: int,
           lengths: Sequence[int], images: RowImages | None = None) -> dict[str, Any]:
    """Pass k's micro-batch of this rank (a zero-loss dummy when it has no rows there but must take
    part), with `rows`, `weights`, the too-stale tokens taken out of `loss_mask` (`stale`) and its sp
    degree `sp` (dynamic sp: > 1 on a shared micro-batch; the placement's own sp is in force otherwise).

    Padded: tensors [B, n], `weights` [B] per row. Packed: tensors [1, n], `segments`, and per token
    `token_rows` [n] (its claim row, -1 where it scores nothing) and `weights` [n]."""
    mb = mini.micro_batches[k] if k < len(mini.micro_batches) else []
    rows = [i for i in mb if i in pulled]
    if not rows:
        batch: dict[str, Any] = dict(dummy_batch(layout.cp_rank))
        batch.update(rows=[], weights=torch.zeros(1), stale=0.0)
        return batch
    sp = mini.sp(k, layout)[0]
    if mini.packed:
        batch = packed_local_batch([pulled.get(i) for i in mb], [lengths[i] for i in mb], mini.windows[k],
                                   sp, fill={VERSION: min_version})
        j = batch["token_rows"]
        valid = j >= 0
        batch["token_rows"] = torch.where(valid, torch.tensor(mb, dtype=torch.int64)[j.clamp(min=0)], -1)
        row_weights = torch.tensor([mini.weights[i] if i in pulled else 0.0 for i in mb], dtype=torch.float32)
        weights = row_weights[j.clamp(min=0)] * valid
        versions = batch.pop(VERSION, None)
    else:
        batch = dict(local_batch([pulled[i] for i in rows], np.zeros(len(rows), np.float32), mini.windows[k]))
        weights = torch.tensor([mini.weights[i] for i in rows], dtype=torch.float32)
        versions = None
        if VERSION in pulled[rows[0]]:
            a, n = mini.windows[k]
            full = torch.full((len(rows), n + 1), min_version, dtype=torch.int64)
            for r, i in enumerate(rows):
                v = pulled[i][VERSION]
                full[r, : len(v)] = torch.from_numpy(v.astype(np.int64))
            versions = full[:, 1:]
        if distill.FIELD in pulled[rows[0]]:
            batch[distill.FIELD] = distill.padded_field([pulled[i] for i in rows], mini.windows[k], distill.FIELD)
    stale = 0.0
    if versions is not None:
        old = (versions < min_version) & (batch["loss_mask"] > 0)
        stale = float(old.sum())
        batch["loss_mask"] = batch["loss_mask"] * (~old).float()
    batch.update(rows=rows, weights=weights, stale=stale, sp=sp if k < mini.shared else 1)
    if images:
        batch["images"] = place_images(mini.micro_batches[k] if mini.packed else None, mini.windows[k][0], rows, images,
                                       lengths)
    return batch


def add_rope(batches: dict[tuple[int, int], dict[str, Any]], minis: Sequence[Mini], described: Described,
              lengths: Sequence[int], vision: VisionInputs) -> None:
    """Give a 3-D RoPE decoder's micro-batches `rope`: every image of their samples, pulled or not (one before a
    sequence-parallel rank's slice shifts the positions of its text), as the samples' metadata records them."""
    for (u, k), batch in batches.items():
        if batch.get("rows"):
            mini = minis[u]
            placed = place_spans(mini.micro_batches[k] if mini.packed else None, mini.windows[k][0], batch["rows"],
                                 described, lengths)
            batch["rope"] = vision.spans(placed)


def pull_claim(client: Puller, metas: Sequence[SampleMeta], rows: Sequence[int],
          ranges: dict[int, list[tuple[int, int]]] | None, fields: tuple[str, ...], with_images: bool = False
          ) -> tuple[dict[int, dict[str, np.ndarray]], list[str], RowImages]:
    """Pull this rank's rows (only `ranges[row]` of a row that has an entry; the others whole), and with
    `with_images` their images; rows whose producer is gone are dropped with their whole group."""
    images: RowImages = {}
    data, errors = _pull_rows(client, metas, rows, ranges, fields, images if with_images else None)
    if not errors:
        return data, [], images
    missing = {sid for exc in errors for sid in exc.sample_ids}
    lost_groups = {metas[i].group_id for i in rows if metas[i].sample_id in missing}
    keep = [i for i in rows if metas[i].group_id not in lost_groups]
    images = {}
    data, errors = _pull_rows(client, metas, keep, ranges, fields, images if with_images else None)
    if errors:
        raise errors[0]
    return data, [m.sample_id for m in metas if m.group_id in lost_groups], images


def _pull_rows(client: Puller, metas: Sequence[SampleMeta], rows: Sequence[int],
               ranges: dict[int, list[tuple[int, int]]] | None, fields: tuple[str, ...], images: RowImages | None = None
               ) -> tuple[dict[int, dict[str, np.ndarray]], list[SamplesUnavailable]]:
    """(the rows pulled, what could not be): whole rows in one pull (checked against their checksums),
    ranged rows in another; with `images`, the rows' images into it."""
    out: dict[int, dict[str, np.ndarray]] = {}
    errors: list[SamplesUnavailable] = []
    whole = [i for i in rows if ranges is None or i not in ranges]
    ranged = [i for i in rows if ranges is not None and i in ranges]
    for part, of in ((whole, None), (ranged, ranges)):
        if not part:
            continue
        try:
            got = pull_samples(client, [metas[i] for i in part], fields,
                               None if of is None else {pos: of[i] for pos, i in enumerate(part)})
            if images is not None:
                pull_row_images(client, metas, part, of, images)
            out.update(zip(part, got))
        except SamplesUnavailable as exc:
            errors.append(exc)
    return out, errors
