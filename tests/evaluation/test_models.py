"""What `earl-stream eval --model` loads (evaluation/models.py): a model directory, a run directory's latest
checkpoint, a LoRA checkpoint (adapters merged into the base it names) and an exported adapter directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from earl_stream.errors import ModelError
from earl_stream.evaluation.models import load_for_eval
from earl_stream.model import load_model
from earl_stream.model.export import export_model
from earl_stream.model.lora import LoraSpec, apply_lora
from earl_stream.workers.checkpoint import RunState, save_checkpoint


def _lora_run(tiny_model_dir: Path, run: Path) -> torch.nn.Module:
    model, tokenizer = load_model(tiny_model_dir)
    apply_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj")))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.arange(5, 29)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # B moves off zero: the adapted model differs from the base
    save_checkpoint(run, RunState(step=1, policy_version=1, rng=torch.get_rng_state(), unreleased=[]), model, opt,
                    tokenizer, collective=False)
    return model.eval()


def test_lora_checkpoint_and_adapter_load_merged(tiny_model_dir: Path, tmp_path: Path) -> None:
    trained = _lora_run(tiny_model_dir, tmp_path / "run")
    base, _ = load_model(tiny_model_dir)
    ids = torch.arange(5, 40)[None]
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-4)
        loaded = load_for_eval(tmp_path / "run")
        assert loaded.kind == "lora checkpoint" and loaded.path.name == "step_000001"
        assert torch.allclose(loaded.model(input_ids=ids).logits, want, atol=1e-4)
        adapter = load_for_eval(export_model(tmp_path / "run", tmp_path / "adapter"))
        assert adapter.kind == "adapter" and torch.allclose(adapter.model(input_ids=ids).logits, want, atol=1e-4)
    assert load_for_eval(tiny_model_dir).kind == "model"


def test_a_missing_base_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    _lora_run(tiny_model_dir, tmp_path / "run")
    with pytest.raises(ModelError, match="pass --base DIR"):
        load_for_eval(tmp_path / "run", base=str(tmp_path / "nowhere"))
