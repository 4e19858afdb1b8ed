"""LoRA (`model.lora`): config refusals, a frozen base, adapter-only versions through the store, the
built-in engine's merge against transformers, checkpoints that hold only the adapter, resume and export."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.config import load_config
from earl_stream.errors import ConfigError, ModelError
from earl_stream.model import load_model
from earl_stream.model.lora import LoraSpec, adapter_state, apply_lora, state_bytes
from earl_stream.store import ShardClient, ShardNode
from earl_stream.store.weights import publish_weights, pull_weights

torch.set_num_threads(1)
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"))


def lora_model(model_dir: Path, spec: LoraSpec = SPEC, *, seed: int = 0) -> Any:
    """The tiny model with adapters whose B is random too (peft starts B at zero: the update would be 0)."""
    model, _ = load_model(model_dir)
    apply_lora(model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _step(model: Any, seed: int = 1) -> None:
    """One AdamW step on a language-model loss, over the trainable parameters only (the trainer's way)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(5, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(("override", "field"), [
    ("model.lora.rank=0", "model.lora.rank"),
    ("model.lora.target_modules=[nope_proj]", "model.lora.target_modules"),
    ("rollout.engine=sglang", "rollout.engine=sglang"),
])
def test_bad_lora_config_is_refused_naming_the_field(tiny_model_dir: Path, override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [f"model.path={tiny_model_dir}", "model.lora.enabled=true", override])


def test_lora_with_vllm_loads_and_with_sglang_is_refused_saying_why(tiny_model_dir: Path) -> None:
    base = [f"model.path={tiny_model_dir}", "model.lora.enabled=true"]
    assert load_config(None, [*base, "rollout.engine=vllm"]).rollout.engine == "vllm"  # vllm_lora serves adapters
    with pytest.raises(ConfigError, match=r"rollout\.engine=sglang cannot apply LoRA adapters.*cannot run on the CPU"):
        load_config(None, [*base, "rollout.engine=sglang"])


def test_lora_config_loads_with_defaults(tiny_model_dir: Path) -> None:
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "model.lora.enabled=true", "model.lora.rank=8"])
    assert cfg.model.lora.rank == 8 and "q_proj" in cfg.model.lora.target_modules
    assert not load_config(None, []).model.lora.enabled


# ------------------------------------------------------------------------------------------ training


def test_only_adapters_train_and_the_base_never_changes(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    _step(model)
    for name, value in model.state_dict().items():
        changed = not torch.equal(value, before[name])
        assert changed == (".lora_" in name), name


# ------------------------------------------------------------------------------------------ weight sync


@pytest.fixture
def store() -> Iterator[tuple[ShardNode, ShardClient]]:
    with ShardNode() as node, ShardClient(timeout_s=10.0) as client:
        yield node, client


def test_a_version_publishes_the_adapters_alone(tiny_model_dir: Path, store: tuple[ShardNode, ShardClient]) -> None:
    node, client = store
    model = lora_model(tiny_model_dir)
    full = load_model(tiny_model_dir)[0].state_dict()
    state = adapter_state(model)
    manifest = publish_weights(node, 1, state)
    pulled = pull_weights(client, node.address, 1)
    assert set(pulled) == set(state) and all(".lora_A." in k or ".lora_B." in k for k in pulled)
    expected = sum(p.numel() * 4 for n, p in model.named_parameters() if p.requires_grad)
    assert manifest.total_bytes == state_bytes(state) == expected
    assert manifest.total_bytes * 10 < state_bytes(full), (manifest.total_bytes, state_bytes(full))


def test_engine_greedy_output_equals_transformers_with_the_merged_adapter(
        tiny_model_dir: Path, store: tuple[ShardNode, ShardClient]) -> None:
    from peft import PeftModel

    from earl_stream.model.lora_export import write_adapter_dir
    from earl_stream.workers.engines.base import GenerateRequest
    from earl_stream.workers.engines.torch_engine import TorchEngine

    node, client = store
    engine = TorchEngine(load_model(tiny_model_dir)[0].eval(), seed=0)
    prompts = [[5, 17, 33, 9], [7, 8, 9, 10, 11, 12]]
    for version in (1, 2):  # a second version replaces the first (merged into the base, not onto it)
        model = lora_model(tiny_model_dir, seed=version)
        publish_weights(node, version, adapter_state(model))
        engine.load_state_dict(pull_weights(client, node.address, version), version)
        got = [r.token_ids for r in engine.generate([GenerateRequest(p, 12, temperature=0.0) for p in prompts])]
        adapter = write_adapter_dir(tiny_model_dir.parent / f"adapter{version}", model, model.state_dict())
        merged = PeftModel.from_pretrained(load_model(tiny_model_dir)[0], str(adapter)).merge_and_unload().eval()
        for prompt, tokens in zip(prompts, got):
            out = merged.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            assert tokens == out[0, len(prompt):].tolist(), version


# ------------------------------------------------------------------------------------------ checkpoints


def _save(run_dir: Path, model: Any, tokenizer: Any) -> Path:
    from earl_stream.workers import checkpoint as ckpt

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(5, 29)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    state = ckpt.RunState(step=1, policy_version=1, rng=torch.get_rng_state(), unreleased=[])
    return ckpt.save_checkpoint(run_dir, state, model, opt, tokenizer, collective=False)


def test_checkpoint_holds_the_adapter_resumes_and_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from earl_stream.model.export import export_model
    from earl_stream.workers import checkpoint as ckpt

    model = lora_model(tiny_model_dir)
    tokenizer = load_model(tiny_model_dir)[1]
    path = _save(tmp_path / "run", model, tokenizer)
    assert not (path / "model.safetensors").exists() and (path / "adapter" / "adapter_model.safetensors").exists()
    dcp_bytes = sum(f.stat().st_size for f in (path / "dcp").iterdir())
    assert dcp_bytes < state_bytes(load_model(tiny_model_dir)[0].state_dict()) / 4, "the base was copied"

    resumed = lora_model(tiny_model_dir, seed=9)  # other adapter values: the checkpoint's must come back
    opt = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2)
    ckpt.load_checkpoint(path, resumed, opt, collective=False)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert len(opt.state) == sum(p.requires_grad for p in resumed.parameters())

    other = lora_model(tiny_model_dir, LoraSpec(rank=8, alpha=8.0, target_modules=("q_proj", "v_proj")))
    with pytest.raises(ModelError, match="rank: 8 here, 4 there"):
        ckpt.load_checkpoint(path, other, torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]),
                             collective=False)

    out = export_model(tmp_path / "run", tmp_path / "merged", merge=True)
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(5, 40)[None]
    model.eval()
    with torch.no_grad():  # W x + B (A x) against (W + B A) x: equal up to float rounding
        assert torch.allclose(exported(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4)
        want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(exported.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                             pad_token_id=0), want)
    adapter = export_model(tmp_path / "run", tmp_path / "adapter")
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()


def test_the_smollm2_lora_config_is_the_full_one_with_adapters(tmp_path: Path) -> None:
    import json

    from earl_stream.config import config_to_dict

    root = Path(__file__).resolve().parents[2] / "configs"
    (tmp_path / "config.json").write_text(json.dumps({  # SmolLM2-135M's shape: its config alone is read
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 2, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}))
    path = f"model.path={tmp_path}"
    lora, full = (config_to_dict(load_config(root / name, [path]))
                  for name in ("smollm2_arithmetic_lora.yaml", "smollm2_arithmetic.yaml"))
    assert lora["model"]["lora"]["enabled"] and lora["model"]["lora"]["rank"] == 1
    for d in (lora, full):
        d["model"].pop("lora"), d["trainer"].pop("lr"), d.pop("run_dir")
    assert lora == full


def test_a_version_on_the_wire_becomes_a_peft_adapter_vllm_can_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's adapter mode writes each pulled version as a PEFT directory (B pre-scaled, so lora_alpha = r):
    peft reads it back to the same model the trainer had."""
    from peft import PeftModel

    from earl_stream.workers.engines.vllm_lora import VllmLora, vllm_max_lora_rank, write_adapter_version

    model = lora_model(tiny_model_dir).eval()
    out = write_adapter_version(adapter_state(model), tmp_path / "v1", str(tiny_model_dir))
    loaded = PeftModel.from_pretrained(load_model(tiny_model_dir)[0], str(out)).eval()
    ids = torch.arange(5, 45)[None]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    assert [vllm_max_lora_rank(r) for r in (1, 4, 16, 17, 512, 513)] == [1, 8, 16, 32, 512, None]
    assert VllmLora(0).llm_args() == {} and VllmLora(600).llm_args() == {}  # not LoRA / too large: merge
    assert VllmLora(4).llm_args()["max_lora_rank"] == 8
