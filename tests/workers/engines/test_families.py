"""The built-in engine serves every dense family of `model.tiny_families`: its greedy tokens equal `transformers`
`generate(do_sample=False)` token for token (prompts of different lengths in one batch), on the decode path each
family is expected to take (so that a regression to the HF-forward fallback shows), also with
`batch_invariant`; and the path choice refuses what it does not understand (an unknown config field, a quirk
that the probe against the HF forward catches)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from earl_stream.model.tiny_families import FAMILIES, init_family_model
from earl_stream.workers.engines import GenerateRequest, TorchEngine
from earl_stream.workers.engines import decode_path as dp
from earl_stream.workers.engines.decode_path import DecodePath
from earl_stream.workers.engines.quirks import Quirks, read_quirks

torch.set_num_threads(1)

FAST, HF = DecodePath.FAST, DecodePath.HF_FORWARD
EXPECTED_PATH = {"llama": FAST, "qwen2": FAST, "qwen3": FAST, "mistral": FAST, "gemma3_text": HF, "phi3": FAST,
                 "smollm3": FAST, "olmo2": FAST, "granite": FAST}
NEW_TOKENS = 16
_rnd = random.Random(0)
PROMPTS = [[_rnd.randrange(1, 512) for _ in range(n)] for n in (3, 11, 24, 7)]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a factory
    root = tmp_path_factory.mktemp("families")

    def make(family: str) -> Path:
        out = root / family
        return out if (out / "config.json").exists() else init_family_model(out, family=family)

    return make


def load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path).eval()


def reference(model: PreTrainedModel, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """`transformers` greedy decoding, one prompt at a time (no padding), never stopping early."""
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def greedy(engine: TorchEngine) -> list[list[int]]:
    reqs = [GenerateRequest(p, NEW_TOKENS, temperature=0.0, stop_token_ids=[]) for p in PROMPTS]
    return [list(r.token_ids) for r in engine.generate(reqs)]


def test_every_family_has_an_expected_path() -> None:
    assert set(EXPECTED_PATH) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(family: str, family_dir) -> None:  # noqa: ANN001
    model = load(family_dir(family))
    engine = TorchEngine(model)
    assert engine.decode_path.path is EXPECTED_PATH[family], engine.decode_path.describe()
    assert engine.admits_while_running == (EXPECTED_PATH[family] is FAST)
    assert greedy(engine) == reference(model)


@pytest.mark.parametrize("family", ["olmo2", "gemma3_text"])
def test_batch_invariant_greedy_and_seeded_rows(family: str, family_dir) -> None:  # noqa: ANN001
    """With `batch_invariant` (OLMo 2 on the fast path, Gemma 3 on the HF forward): greedy tokens still equal
    `generate`'s, and a seeded row samples bitwise the same tokens and log-probs batched or alone."""
    model = load(family_dir(family))
    engine = TorchEngine(model, batch_invariant=True)
    assert engine.decode_path.path is EXPECTED_PATH[family]
    assert greedy(engine) == reference(model)
    reqs = [GenerateRequest(p, 8, temperature=1.0, seed=10 + i, stop_token_ids=[]) for i, p in enumerate(PROMPTS)]
    together = [(list(r.token_ids), list(r.logprobs)) for r in engine.generate(reqs)]
    alone = [(list(r.token_ids), list(r.logprobs)) for req in reversed(reqs) for r in engine.generate([req])]
    assert together == alone[::-1]


def test_an_unknown_config_field_refuses_the_fast_path(family_dir) -> None:  # noqa: ANN001
    model = load(family_dir("qwen2"))
    model.config.attention_temperature = 0.5  # a quirk the fast decoder does not know
    choice = TorchEngine(model).decode_path
    assert choice.path is HF and "attention_temperature" in choice.reason
    assert not isinstance(read_quirks(model), Quirks)


def test_the_probe_refuses_a_misread_quirk(family_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Granite read as if it had no multipliers: the probe against the HF forward sees it and falls back."""
    model = load(family_dir("granite"))
    read = read_quirks(model)
    assert isinstance(read, Quirks) and read.residual_multiplier == 0.5
    monkeypatch.setattr(dp, "read_quirks", lambda _: Quirks(read.qk_norm, read.post_norm, read.rope_layers))
    choice = dp.choose_path(model)
    assert choice.path is HF and "differ from the HF forward" in choice.reason and choice.decoder is None


def test_the_hf_forward_admits_rows_into_a_running_batch(family_dir) -> None:  # noqa: ANN001
    """A full-attention model on the HF forward batches continuously: rows join a batch already decoding (its
    DynamicCache re-aligned), a long row leaves early (its padding then trimmed from the others), and every row's
    greedy tokens are still `generate`'s. (Gemma 3's sliding-window cache layers cannot be re-aligned: it runs
    batch to completion.)"""
    model = load(family_dir("llama"))
    engine = TorchEngine(model, fast_forward=False)
    assert engine.decode_path.path is HF and engine.admits_while_running
    prompts = [PROMPTS[0], PROMPTS[1], list(range(1, 61)), PROMPTS[3]]
    reqs = [GenerateRequest(p, n, temperature=0.0, stop_token_ids=[]) for p, n in zip(prompts, (16, 11, 1, 16))]
    rows = engine.submit(reqs[:2])
    with engine._lock:  # noqa: SLF001 - drive a few decode steps by hand, then let the others join
        for _ in range(4):
            engine.step()
    rows += engine.submit(reqs[2:])
    engine.drive()
    assert engine.stats.admitted_while_running == 2
    want = reference(model, prompts)
    assert [list(r.result.token_ids) for r in rows] == [w[: r.max_new_tokens] for w, r in zip(want, reqs)]
