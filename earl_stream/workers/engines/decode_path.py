"""Which forward the built-in engine decodes with, and why: its own fast decoder or the Hugging Face forward.

It owns `choose_path(model, fast_forward=...)`: the fast decoder is taken only when every quirk of the model
is one it understands (`quirks.read_quirks`, an allow-list of quirks read from the config and the modules)
and its logits equal the HF forward's on a short probe (a last guard against a quirk that lives in code
only); otherwise the HF forward, with the reasons. The choice is logged once per process and model family,
and kept on the engine (`TorchEngine.decode_path`) for status and tests. It leaves the forward itself to
`fast_decoder` and the scheduling to `torch_engine`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from earl_stream.workers.engines.fast_decoder import FastDecoder
from earl_stream.workers.engines.quirks import Quirks, read_quirks
from earl_stream.workers.engines.vision import takes_images

_LOG = logging.getLogger(__name__)
_PROBE_TOKENS = 12
_PROBE_TOL = {torch.float32: 1e-4, torch.float64: 1e-8}  # x (1 + max |logit|); half precision: _HALF_TOL
_HALF_TOL = 5e-2
_logged: set[tuple[str, str, str]] = set()


class DecodePath(enum.Enum):
    FAST = "fast"  # the engine's own forward (`fast_decoder`), continuous batching
    HF_FORWARD = "hf_forward"  # the Hugging Face model's forward with a DynamicCache (continuous batching only
    # when every layer is full attention)


@dataclass(frozen=True)
class PathChoice:
    """The forward an engine decodes with: `family` (config model_type), `reason` in a few words, and for the
    fast path its `quirks` and the decoder built (and probed) for it."""

    path: DecodePath
    family: str
    reason: str
    quirks: Quirks | None = None
    decoder: FastDecoder | None = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        forward = "the fast decoder" if self.path is DecodePath.FAST else "the Hugging Face forward"
        return f"engine: {self.family} uses {forward} ({self.reason})"


def choose_path(model: PreTrainedModel, *, fast_forward: bool = True) -> PathChoice:
    """Pick the decode path for `model` (see the module docstring); logs the choice once per family."""
    family = str(getattr(model.config, "model_type", None) or type(model).__name__)
    choice = _choose(model, family, fast_forward)
    key = (family, choice.path.value, choice.reason)
    if key not in _logged:
        _logged.add(key)
        _LOG.info("%s", choice.describe())
    return choice


def _choose(model: PreTrainedModel, family: str, fast_forward: bool) -> PathChoice:
    if not fast_forward:
        return PathChoice(DecodePath.HF_FORWARD, family, "fast_forward=False")
    if takes_images(model):
        return PathChoice(DecodePath.HF_FORWARD, family, "a vision-language model: its vision tower runs in the HF "
                          "forward")
    quirks = read_quirks(model)
    if not isinstance(quirks, Quirks):
        return PathChoice(DecodePath.HF_FORWARD, family, "; ".join(quirks))
    decoder = FastDecoder(model, quirks)
    gap, tol = probe_gap(model, decoder)
    if not gap <= tol:  # also refuses NaN
        return PathChoice(DecodePath.HF_FORWARD, family, f"the fast decoder's logits differ from the HF forward's "
                          f"on a probe by {gap:.3g} (> {tol:.3g}): a quirk not understood")
    return PathChoice(DecodePath.FAST, family, quirks.describe(), quirks, decoder)


def probe_gap(model: PreTrainedModel, decoder: FastDecoder) -> tuple[float, float]:
    """Largest |logit| difference between `decoder` and the HF forward over a fixed probe of `_PROBE_TOKENS`
    tokens, and the tolerance for the model's dtype (both relative to 1 + the largest |logit|)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, decoder.vocab_size, (1, _PROBE_TOKENS), generator=gen).to(decoder.device)
    positions = torch.arange(_PROBE_TOKENS, device=decoder.device)[None]
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()
        got = decoder.forward(ids, positions, mask, decoder.new_cache(1, _PROBE_TOKENS), last_only=False).float()
    scale = 1.0 + float(ref.abs().max())
    return float((got - ref).abs().max()) / scale, _PROBE_TOL.get(decoder.dtype, _HALF_TOL)
