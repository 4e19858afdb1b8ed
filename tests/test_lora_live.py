"""A LoRA run end to end (`up` with `model.lora`, two trainer ranks): each version moves the adapters
alone (the summary's bytes per version are theirs), the checkpoint holds a PEFT adapter, and
`earl-stream model export --merge` writes a model that transformers loads and that equals base + adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.target_modules=[q_proj,v_proj,down_proj]"]


@pytest.mark.live
def test_lora_run_moves_only_adapters_and_exports_a_merged_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from earl_stream.model import load_model
    from earl_stream.model.lora import LoraSpec, adapter_state, apply_lora, state_bytes

    run, summary = tmp_path / "run", tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           f"model.path={tiny_model_dir}", f"run_dir={run}", "trainer.groups_per_step=2", "trainer.group_size=4",
           "trainer.nproc=2", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2", *LORA]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["steps"] == 2

    model, _ = load_model(tiny_model_dir)
    full_bytes = state_bytes(model.state_dict())
    apply_lora(model, LoraSpec(rank=4, alpha=32.0, target_modules=("q_proj", "v_proj", "down_proj")))
    assert s["weight_bytes_per_version"] == state_bytes(adapter_state(model)) < full_bytes / 20

    ckpt = run / "checkpoints" / "step_000002"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-m", "earl_stream", "model", "export", str(run), str(out), "--merge"],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    adapted = PeftModel.from_pretrained(load_model(tiny_model_dir)[0], str(ckpt / "adapter")).eval()
    ids = torch.arange(5, 45)[None]
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4)
