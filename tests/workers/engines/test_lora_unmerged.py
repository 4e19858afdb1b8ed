"""The built-in engine applies a LoRA version unmerged (`engines.adapters`): on every decode path (the fast decoder
with its fused q/k/v and gate/up projections, batch-invariant or not, and the HF forward) its greedy tokens equal
the merged model's and its log-probs are within 1e-5 (fp32); a version swap leaves the base weights, and the fast
decoder's fused copies of them, bit-identical; a full version drops the adapter. And weights are published once per
tensor: a tied model's version holds its unique parameter bytes, and an engine loads it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.model import load_model
from earl_stream.model.lora import LoraSpec, adapter_state, apply_lora, merged_weights, state_bytes
from earl_stream.store import ShardClient, ShardNode
from earl_stream.store.layout import Layout
from earl_stream.store.weights import publish_weights, pull_weights
from earl_stream.workers.engines.base import GenerateRequest, GenerateResult
from earl_stream.workers.engines.torch_engine import TorchEngine

torch.set_num_threads(1)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SOME = ("q_proj", "v_proj", "up_proj", "down_proj")  # k and gate without: zero blocks in the fused updates
PROMPTS = [[5, 17, 33, 9], [7, 8, 9, 10, 11, 12], [40, 41]]
LOGPROB_TOL = 1e-5


@pytest.fixture
def store() -> Iterator[tuple[ShardNode, ShardClient]]:
    with ShardNode() as node, ShardClient(timeout_s=10.0) as client:
        yield node, client


def _version(model_dir: Path, targets: tuple[str, ...], seed: int) -> dict[str, torch.Tensor]:
    """A LoRA version on the wire whose B is random (peft starts B at zero: the update would be 0)."""
    model, _ = load_model(model_dir)
    apply_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=targets), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return adapter_state(model)


def _merged_engine(model_dir: Path, state: dict[str, torch.Tensor], **kw: Any) -> TorchEngine:
    model = load_model(model_dir)[0].eval()
    model.load_state_dict({**model.state_dict(), **merged_weights(state, model.state_dict())})
    return TorchEngine(model, **kw)


def _greedy(engine: TorchEngine) -> list[GenerateResult]:
    return engine.generate([GenerateRequest(p, 16, temperature=0.0) for p in PROMPTS])


def _assert_same(got: list[GenerateResult], want: list[GenerateResult]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= LOGPROB_TOL


@pytest.mark.parametrize(("fast", "invariant"), [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("targets", [ALL, SOME], ids=["all", "some"])
def test_unmerged_lora_equals_the_merged_model(tiny_model_dir: Path, store: tuple[ShardNode, ShardClient],
                                               fast: bool, invariant: bool, targets: tuple[str, ...]) -> None:
    node, client = store
    kw = {"fast_forward": fast, "batch_invariant": invariant}
    engine = TorchEngine(load_model(tiny_model_dir)[0].eval(), **kw)
    assert (engine.decode_path.decoder is not None) == fast
    for version in (1, 2):  # the second replaces the first: never base + both
        state = _version(tiny_model_dir, targets, seed=version)
        publish_weights(node, version, state)
        engine.load_state_dict(pull_weights(client, node.address, version), version)
        _assert_same(_greedy(engine), _greedy(_merged_engine(tiny_model_dir, state, **kw)))


def test_a_lora_swap_leaves_the_base_bit_identical_and_a_full_version_drops_it(tiny_model_dir: Path) -> None:
    engine = TorchEngine(load_model(tiny_model_dir)[0].eval())
    model, fast = engine._model, engine.decode_path.decoder
    assert fast is not None
    base = {k: v.clone() for k, v in model.state_dict().items()}
    fused = [(lay.qkv_w.clone(), lay.gate_up_w) for lay in fast._fused]
    before = _greedy(engine)
    for version in (1, 2, 3):
        engine.load_state_dict(_version(tiny_model_dir, ALL if version % 2 else SOME, seed=version), version)
        assert [r.token_ids for r in _greedy(engine)] != [r.token_ids for r in before]  # the adapter is applied
    for name, value in model.state_dict().items():
        assert torch.equal(value, base[name]), name
    for lay, (qkv, gate_up) in zip(fast._fused, fused, strict=True):  # not even re-fused
        assert torch.equal(lay.qkv_w, qkv) and lay.gate_up_w is gate_up
    engine.load_state_dict(base, 4)  # a full version: the whole model, no adapter on top
    _assert_same(_greedy(engine), before)


def test_a_bad_adapter_is_refused_and_changes_nothing(tiny_model_dir: Path) -> None:
    from earl_stream.errors import EngineError

    engine = TorchEngine(load_model(tiny_model_dir)[0].eval())
    state = _version(tiny_model_dir, ALL, seed=1)
    engine.load_state_dict(state, 1)
    want = _greedy(engine)
    bad = dict(state)
    name = next(k for k in bad if k.endswith("q_proj.lora_B.weight"))
    bad[name] = torch.full_like(bad[name], float("nan"))
    with pytest.raises(EngineError, match="non-finite"):
        engine.load_state_dict(bad, 2)
    bad[name] = torch.zeros(3, 4)
    with pytest.raises(EngineError, match="do not fit"):
        engine.load_state_dict(bad, 2)
    assert engine.policy_version == 1
    _assert_same(_greedy(engine), want)


# ------------------------------------------------------------------------------------------ tied weights


def _tied_model(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("world", [1, 2])
def test_a_tied_model_publishes_its_unique_parameter_bytes_once(world: int, store: tuple[ShardNode, ShardClient]
                                                                ) -> None:
    import types

    from earl_stream.workers.sharding import shard_pieces

    node, client = store
    model = _tied_model()
    state = model.state_dict()
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() names a tied one once
    assert state_bytes(state) == unique
    assert publish_weights(node, 1, state).total_bytes == unique
    per_rank = [shard_pieces(state, types.SimpleNamespace(layout=Layout.from_rank(r, dp=world), world=world))
                for r in range(world)]
    names = [p.name for pieces in per_rank for p in pieces]
    assert "lm_head.weight" not in names and len(names) == len(set(names)) == len(state) - 1
    assert sum(p.tensor.numel() * p.tensor.element_size() for pieces in per_rank for p in pieces) == unique
    pulled = pull_weights(client, node.address, 1)
    assert set(pulled) == set(state) - {"lm_head.weight"}


def test_an_engine_loads_a_tied_version_published_once(store: tuple[ShardNode, ShardClient]) -> None:
    node, client = store
    trained, engine_model = _tied_model(seed=1), _tied_model(seed=2)
    engine = TorchEngine(engine_model)
    publish_weights(node, 1, trained.state_dict())
    engine.load_state_dict(pull_weights(client, node.address, 1), 1)
    assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight  # still one tensor
    for name, value in trained.state_dict().items():
        assert torch.equal(engine_model.state_dict()[name], value), name
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        assert torch.equal(engine_model(input_ids=ids).logits, trained(input_ids=ids).logits)
