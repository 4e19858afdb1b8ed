"""LoRA versions in the vLLM engine (run by `make test-vllm`; skipped where vllm is absent): adapter-only
versions go through the store and, once pulled, vLLM's greedy output equals transformers with the merged
adapter, served as a vLLM LoRA adapter (`auto`, which is the adapter mode wherever vLLM serves LoRA, CPU
included) and by the merge-and-reload fallback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_skip import require_engine

from earl_stream.errors import EngineError
from earl_stream.model import load_model
from earl_stream.model.lora import LoraSpec, adapter_state, apply_lora, state_bytes
from earl_stream.store import ShardClient, ShardNode
from earl_stream.store.weights import publish_weights, pull_weights
from earl_stream.workers.engines import GenerateRequest

pytestmark = pytest.mark.vllm
require_engine("vllm")

from earl_stream.workers.engines.vllm_engine import VllmEngine  # noqa: E402  (after the skip: needs vllm)

torch.set_num_threads(1)
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"))
PROMPTS = [[5, 17, 33, 9], [7, 8, 9, 10, 11, 12], [300, 41, 77]]


@pytest.fixture(scope="module")
def sharp(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with an 8x output head: peaked next-token distributions (no near-ties in greedy)."""
    model, tokenizer = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    out = tmp_path_factory.mktemp("sharp")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[ShardNode, ShardClient]]:
    with ShardNode() as node, ShardClient(timeout_s=30.0) as client:
        yield node, client


def trained(model_dir: Path, seed: int) -> Any:
    """The model with adapters as training leaves them: A and B both non-zero (B is zero at peft's init)."""
    model, _ = load_model(model_dir)
    apply_lora(model, SPEC)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def merged_greedy(model_dir: Path, model: Any, out: Path) -> list[list[int]]:
    """transformers' greedy continuation of PROMPTS with the adapter merged by peft (the reference)."""
    from peft import PeftModel

    from earl_stream.model.lora_export import write_adapter_dir

    adapter = write_adapter_dir(out, model, model.state_dict())
    merged = PeftModel.from_pretrained(load_model(model_dir)[0], str(adapter)).merge_and_unload().eval()
    with torch.inference_mode():
        return [merged.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize(("mode", "ran"), [("auto", "adapter"), ("merge", "merge")])
def test_pulled_lora_versions_generate_like_transformers_with_the_merged_adapter(
        sharp: Path, store: tuple[ShardNode, ShardClient], tmp_path: Path, mode: str, ran: str,
        record_property: pytest.RecordProperty) -> None:
    node, client = store
    full_bytes = state_bytes(load_model(sharp)[0].state_dict())
    seen: list[list[list[int]]] = []
    with VllmEngine(sharp, max_batch_size=4, kv_budget_tokens=1024, seed=0, lora_rank=SPEC.rank,
                    lora_mode=mode) as engine:
        base = [r.token_ids for r in engine.generate([GenerateRequest(p, 12, temperature=0.0) for p in PROMPTS])]
        for version in (1, 2):  # the second version replaces the first (never stacked on it)
            model = trained(sharp, seed=version)
            manifest = publish_weights(node, version + (10 if mode == "merge" else 0), adapter_state(model))
            pulled = pull_weights(client, node.address, manifest.version)
            # only the adapter's bytes crossed the store: A and B of every adapted layer, nothing of the base
            assert pulled and all(".lora_A." in k or ".lora_B." in k for k in pulled)
            assert manifest.total_bytes == sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
            assert manifest.total_bytes * 10 < full_bytes, (manifest.total_bytes, full_bytes)
            engine.load_state_dict(pulled, version)
            results = engine.generate([GenerateRequest(p, 12, temperature=0.0) for p in PROMPTS])
            assert all(r.policy_version == version for r in results)
            got = [r.token_ids for r in results]
            assert got == merged_greedy(sharp, model, tmp_path / f"adapter{version}"), version
            seen.append(got)
        assert engine.lora_mode == ran
        applied = "lora_versions_as_adapter" if ran == "adapter" else "lora_versions_merged"
        assert engine.lora_stats()[applied] == 2 and sum(engine.lora_stats().values()) == 2
        # the versions really changed the output (the checks above would pass on a stale engine otherwise)
        assert base != seen[0] and seen[0] != seen[1]
        bad = {k: v[:, :-1] if ".lora_A." in k else v for k, v in adapter_state(trained(sharp, seed=3)).items()}
        with pytest.raises(EngineError, match="rejected, nothing was loaded"):
            engine.load_state_dict(bad, 3)
        again = [r.token_ids for r in engine.generate([GenerateRequest(p, 12, temperature=0.0) for p in PROMPTS])]
        assert again == seen[1] and engine.policy_version == 2
    record_property("vllm_lora_mode", ran)
    record_property("adapter_bytes_per_version", manifest.total_bytes)
    record_property("full_model_bytes", full_bytes)
