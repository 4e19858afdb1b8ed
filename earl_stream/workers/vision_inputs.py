"""The trainer's images: a vision-language policy's forward over a micro-batch recomputes the vision tower
for the images whose tokens the micro-batch holds, and puts each image's features where its image tokens are.

A sample's pictures come from the store whole (`store.experience.pull_images`: every image whose span meets the
rank's token ranges), so a sequence-parallel rank whose slice cuts an image runs the tower over the whole image and
keeps the features of its own positions; the gradients of the tower then sum over the ranks like those of any
replicated weight. Compressed pixels move, not activations. The processor's tensors are those the engine saw
(`model.vision.VisionChat.prompt_image`, the same code and the same cache), so the trainer's log-probs are the
engine's.

`BatchImage` places an image in a micro-batch: batch row, and the offset from the sample's positions to the
micro-batch's local positions (packed: the row's start in the packed sequence less the rank's window start;
padded: less the window start): `place_images` from the rows' images that `pull_row_images` pulled with them.
`VisionInputs.embeds` gives the decoder's input embeddings of a micro-batch:
the token embeddings, with the image features scattered over the image tokens the rank holds; `merged` makes the
model's forward use them. It does so from a forward pre-hook of the model, after FSDP's own has gathered the
weights the root holds (the embedding table, the tower's and connector's): the forward is called with input_ids
as for any model and the hook replaces them with the embeddings.

Families: Idefics3 / SmolVLM and Qwen2-VL / Qwen2.5-VL (the model's `model.get_image_features`, image tokens
`config.image_token_id`). The Qwen2-VL family's decoder takes 3-D positions (`model.mrope`): the forward pre-hook
also turns the micro-batch's 1-D positions into them, from the sizes of every image of its samples (`ImageSpan`:
the images before a sequence-parallel rank's slice shift its text too, pulled or not; `place_spans` places them
from what the samples' metadata records of their images, `Described`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from earl_stream.errors import ConfigError, ModelError
from earl_stream.model.mrope import ImageSpan, image_grid, mrope_positions
from earl_stream.records import SampleImage
from earl_stream.store.experience import Puller, pull_images, pull_samples
from earl_stream.store.schema import SampleMeta

__all__ = ["BatchImage", "Described", "RowImages", "VisionInputs", "is_vision_model", "place_images", "place_spans",
           "pull_row_images", "vision_parameters"]


@dataclasses.dataclass(frozen=True)
class BatchImage:
    """An image of a micro-batch: its sample's `image` (span in sample positions), the batch `row`, and `offset`
    (local position = offset + sample position). `span_ids`: the span's input_ids when this rank does not hold
    all of them (a sequence-parallel slice that cuts the image), else None (read from the batch)."""

    row: int
    offset: int
    image: SampleImage
    span_ids: np.ndarray | None = None


RowImages = dict[int, list[tuple[SampleImage, "np.ndarray | None"]]]  # claim row -> its images (and span ids)
Described = dict[int, list[tuple[int, int, int, int]]]  # claim row -> each image's (start, tokens, width, height)


def pull_row_images(client: Puller, metas: Sequence[SampleMeta], part: Sequence[int],
                 of: dict[int, list[tuple[int, int]]] | None, into: RowImages) -> None:
    """The images of rows `part` whose spans meet their pulled ranges (`of[row]`; None: whole rows), each with its
    span's input_ids when the ranges do not hold all of them (pulled too: the image's tokens say where its
    features go)."""
    got = pull_images(client, [metas[i] for i in part], None if of is None else {pos: of[i] for pos, i in enumerate(part)})
    cut = {i: [img for img in found if not any(a <= img.start and img.start + img.tokens <= b for a, b in of[i])]
           for i, found in zip(part, got)} if of is not None else {}
    cut = {i: imgs for i, imgs in cut.items() if imgs}
    spans: dict[tuple[int, int], np.ndarray] = {}
    if cut:  # one pull of every cut image's span, row by row (a row's ranges come back concatenated)
        rows = list(cut)
        pulled = pull_samples(client, [metas[i] for i in rows], ("input_ids",),
                              {pos: [(img.start, img.start + img.tokens) for img in cut[i]] for pos, i in enumerate(rows)})
        for i, row in zip(rows, pulled):
            parts = np.split(row["input_ids"], np.cumsum([img.tokens for img in cut[i]])[:-1])
            spans.update({(i, img.start): ids for img, ids in zip(cut[i], parts)})
    for i, found in zip(part, got):
        into[i] = [(img, spans.get((i, img.start))) for img in found]


def _placed(packing: Sequence[int] | None, start: int, rows: Sequence[int],
            lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """(batch row, offset, claim row) of each pulled row of a micro-batch (see `place_images`)."""
    if packing is None:
        return [(r, -start, i) for r, i in enumerate(rows)]
    out: list[tuple[int, int, int]] = []
    o = 0
    for i in packing:
        if i in rows:
            out.append((0, o - start, i))
        o += lengths[i]
    return out


def place_images(packing: Sequence[int] | None, start: int, rows: Sequence[int], images: RowImages,
                 lengths: Sequence[int]) -> list[BatchImage]:
    """Where a micro-batch's images go: `rows` are its claim rows that were pulled, in batch order; `start` is the
    rank's window start. Packed (`packing`: the micro-batch's claim rows in packing order, lost ones included: their
    spans stay in place), one batch row in which a sample starts at its offset; padded (None), a row per sample."""
    return [BatchImage(r, o, img, ids) for r, o, i in _placed(packing, start, rows, lengths) for img, ids in images.get(i, ())]


def place_spans(packing: Sequence[int] | None, start: int, rows: Sequence[int], described: Described,
                lengths: Sequence[int]) -> list[tuple[int, int, tuple[int, int, int, int]]]:
    """(batch row, offset, (start, tokens, width, height)) of every image of a micro-batch's samples, placed as
    `place_images` places the pulled ones: what `VisionInputs.spans` turns into 3-D RoPE spans."""
    return [(r, o, d) for r, o, i in _placed(packing, start, rows, lengths) for d in described.get(i, ())]


def is_vision_model(model: torch.nn.Module) -> bool:
    """Whether `model` is an image-text-to-text model this trainer can feed images (Idefics3 / SmolVLM: its tower
    is `vision_model`; Qwen2-VL / Qwen2.5-VL: `visual`)."""
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "get_image_features") and (
        hasattr(inner, "vision_model") or hasattr(inner, "visual"))


def vision_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The vision tower's and its connector's parameters (what `model.freeze_vision` freezes; Qwen2-VL's merger
    is part of its `visual`)."""
    inner: Any = getattr(model, "model", None)
    parts = [getattr(inner, name, None) for name in ("vision_model", "connector", "visual")]
    return [p for part in parts if part is not None for p in part.parameters()]


class VisionInputs:
    """Input embeddings with images for the forward passes of a vision-language policy."""

    def __init__(self, processor: Any, model: torch.nn.Module) -> None:
        from earl_stream.model.vision import VisionChat

        if not is_vision_model(model):
            raise ModelError(f"{type(model).__name__} is not a vision-language model earl_stream trains with images "
                             "(Idefics3 / SmolVLM, Qwen2-VL / Qwen2.5-VL)")
        self.chat = VisionChat(processor)
        self.mrope = self.chat.mrope  # the decoder takes 3-D positions
        config: Any = model.config
        self.image_token_id = int(config.image_token_id)
        if self.image_token_id != self.chat.image_token_id:
            raise ModelError(f"the model's image token {self.image_token_id} is not its processor's "
                             f"({self.chat.image_token_id})")

    def spans(self, placed: Sequence[tuple[int, int, tuple[int, int, int, int]]]) -> list[ImageSpan]:
        """The 3-D RoPE spans of `place_spans`' images (each one's grid from its size and the image processor)."""
        ip = self.chat.processor.image_processor
        return [ImageSpan(r, o, s, t, *image_grid(ip, w, h)) for r, o, (s, t, w, h) in placed]

    @contextlib.contextmanager
    def merged(self, model: torch.nn.Module, images: Sequence[BatchImage],
               spans: Sequence[ImageSpan] | None = None) -> Iterator[None]:
        """While inside, `model`'s forward takes its input_ids with `images` merged (`embeds`) and, for a decoder
        with 3-D positions, its 1-D position_ids (none: 0.. per row) laid out for `spans`, every image of the
        micro-batch's samples (None: `images` are all of them)."""
        if self.mrope and spans is None:
            spans = self.spans([(b.row, b.offset, (b.image.start, b.image.tokens, b.image.image.width,
                                                    b.image.image.height)) for b in images])

        def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            ids = kwargs.pop("input_ids")
            kwargs["inputs_embeds"] = self.embeds(module, ids, images)
            if self.mrope:
                flat = kwargs.get("position_ids")
                if flat is None:
                    flat = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
                # the text positions first: what the model's own packed-sequence mask reads
                kwargs["position_ids"] = torch.cat([flat[None], mrope_positions(flat, spans or ())])
            return args, kwargs

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def embeds(self, model: torch.nn.Module, input_ids: torch.Tensor, images: Sequence[BatchImage]) -> torch.Tensor:
        """[B, n, hidden]: `input_ids`' embeddings, image tokens replaced by their images' features (the vision
        tower runs over every image of `images`; only the positions inside [0, n) are kept)."""
        hf: Any = model
        embeds = hf.get_input_embeddings()(input_ids)
        if not images:
            return embeds
        inputs = [self.chat.prompt_image(b.image).inputs for b in images]  # the engine's tensors, every tile
        tiles = self._features(hf, inputs, input_ids.device)
        rows: list[int] = []
        cols: list[int] = []
        picked: list[torch.Tensor] = []
        n = input_ids.shape[1]
        for b, feats in zip(images, tiles):
            s, t = b.image.start, b.image.tokens
            if b.span_ids is not None:
                ids = torch.from_numpy(np.asarray(b.span_ids, dtype=np.int64))
            else:
                lo, hi = b.offset + s, b.offset + s + t
                if lo < 0 or hi > n:
                    raise ConfigError(f"an image at positions [{s}, {s + t}) of its sample is cut by this micro-batch "
                                      "and its span's tokens were not pulled")
                ids = input_ids[b.row, lo:hi].cpu()
            hits = torch.nonzero(ids == self.image_token_id).flatten()
            flat = feats.reshape(-1, feats.shape[-1])
            if len(hits) != flat.shape[0]:
                raise ModelError(f"an image's span holds {len(hits)} image tokens but its pictures give "
                                 f"{flat.shape[0]} features")
            local = hits + b.offset + s
            keep = (local >= 0) & (local < n)
            rows += [b.row] * int(keep.sum())
            cols += local[keep].tolist()
            picked.append(flat[keep.to(flat.device)])
        if not rows:  # this rank's slice holds markers of its images, none of their image tokens
            return embeds
        values = torch.cat(picked).to(embeds.dtype)
        index = (torch.tensor(rows, dtype=torch.long, device=embeds.device),
                 torch.tensor(cols, dtype=torch.long, device=embeds.device))
        return embeds.index_put(index, values)

    def _features(self, hf: Any, inputs: Sequence[Mapping[str, torch.Tensor]], device: torch.device
                  ) -> Sequence[torch.Tensor]:
        """Each image's features: Idefics3, [tiles, tokens per tile, hidden]; Qwen2-VL, [tokens, hidden]."""
        if self.mrope:  # patches of every image back to back, and their grids
            pixels = torch.cat([i["pixel_values"] for i in inputs]).to(device)
            grids = torch.cat([i["image_grid_thw"] for i in inputs]).to(device)
            return hf.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        pix = {k: torch.cat([i[k] for i in inputs]).to(device)[None] for k in inputs[0]}
        out = hf.model.get_image_features(pix["pixel_values"], pix.get("pixel_attention_mask"), return_dict=True)
        return torch.split(out.pooler_output, [int(i["pixel_values"].shape[0]) for i in inputs])
