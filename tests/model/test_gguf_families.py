"""`earl-stream model import` of every family transformers reads from GGUF: a tiny random model of each,
written as llama.cpp writes it (tests/model/gguf_writer.py), imports to an HF directory that loads back
with the right model_type and the same logits; a family transformers cannot read is one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from earl_stream.errors import ModelError
from earl_stream.model import import_model
from earl_stream.model.importing import supported_gguf_architectures
from earl_stream.model.tiny_families import init_family_model
from earl_stream.model.tiny_moe import init_moe_model

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'earl_stream[real-model]')")
pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF files")
from model.gguf_writer import GGUF_ARCH, write_gguf  # noqa: E402  (needs gguf)

torch.set_num_threads(1)
IDS = torch.tensor([[1, 17, 250, 3, 99, 400, 7, 511, 42, 5]])


def _reference(root: Path, family: str) -> PreTrainedModel:
    """The tiny model of `family`, less what a GGUF cannot state (so llama.cpp would not write it either)."""
    src = root / family
    if family == "qwen3_moe":
        init_moe_model(src, family=family)
    else:  # Gemma 3 with 6 layers: llama.cpp fixes its pattern at five sliding layers, then one global one
        init_family_model(src, family=family, num_layers=6 if family == "gemma3_text" else 2)
    config = AutoConfig.from_pretrained(src)
    if family == "gemma3_text":
        config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)]
    return AutoModelForCausalLM.from_pretrained(src, config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "phi3"])
def test_gguf_of_each_family_imports_to_the_same_logits(family: str, tmp_path: Path) -> None:
    model = _reference(tmp_path, family)
    path = write_gguf(tmp_path / f"{family}.gguf", model, tmp_path / family)
    report = import_model(path, tmp_path / "out")
    assert (report.source_format, report.model_type) == ("gguf", family)
    assert report.parameters == sum(p.numel() for p in model.parameters())
    imported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert imported.config.model_type == family and next(imported.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(imported(input_ids=IDS).logits, model(input_ids=IDS).logits, atol=1e-4, rtol=1e-4)


def test_a_family_transformers_cannot_read_from_gguf_is_one_clear_error(tmp_path: Path) -> None:
    model = _reference(tmp_path, "olmo2")
    path = write_gguf(tmp_path / "olmo2.gguf", model, tmp_path / "olmo2")
    assert GGUF_ARCH["olmo2"] not in supported_gguf_architectures()
    with pytest.raises(ModelError) as info:
        import_model(path, tmp_path / "out")
    message = str(info.value)
    assert f"{path} holds a 'olmo2' model, which transformers cannot load from GGUF" in message
    assert "llama, " in message and "qwen3moe" in message and "\n" not in message
    assert not (tmp_path / "out").exists()
