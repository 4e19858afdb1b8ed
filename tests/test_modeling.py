"""Tiny model creation, loading through the Hugging Face Auto classes, errors, and the default model."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from transformers import ViTConfig

from earl_stream.config import RunConfig
from earl_stream.errors import ModelError
from earl_stream.model import (
    SPECIAL_TOKENS,
    count_parameters,
    default_model_dir,
    ensure_default_model,
    init_model,
    load_model,
    load_tokenizer,
)
from earl_stream.model.tiny import _train_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_default_model_size_and_format(model_dir: Path) -> None:
    model, tok = load_model(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and not model.training
    assert 1_000_000 <= count_parameters(model) <= 2_000_000
    assert model.config.tie_word_embeddings is False
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    assert len(tok) <= model.config.vocab_size == 512
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|pad|>", "<|endoftext|>", "<|endoftext|>")
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)
    ids = torch.tensor([tok.encode("1 2 3\n4 5 6\n7 8 9", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    half, _ = load_model(model_dir, dtype=torch.bfloat16)
    assert next(half.parameters()).dtype == torch.bfloat16


def test_saved_tokenizer_equals_the_trained_one(model_dir: Path) -> None:
    # transformers loads qwen2 directories with Qwen2Tokenizer; tokenization must not change.
    loaded, trained = load_tokenizer(model_dir), _train_tokenizer(512)
    texts = ["X O 3\n4 X 6\n7 8 O", "(hello) don't 1234!\n\n  ok", "café ✓ naïve", '{"a": [1, 2]}']
    for text in texts:
        assert loaded.encode(text, add_special_tokens=False) == trained.encode(text, add_special_tokens=False)


def test_init_is_deterministic_per_seed(tmp_path: Path, model_dir: Path) -> None:
    same = init_model(tmp_path / "same", seed=0)
    other = init_model(tmp_path / "other", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (same / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def one_line_model_error(path: Path) -> str:
    with pytest.raises(ModelError) as info:
        load_model(path)
    message = str(info.value)
    exc = info.value
    assert "\n" not in message and exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__  # no chained library traceback
    return message


def test_clear_errors(tmp_path: Path, model_dir: Path) -> None:
    assert "does not exist" in one_line_model_error(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in one_line_model_error(tmp_path / "empty")
    vit = tmp_path / "vit"
    ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8).save_pretrained(vit)
    assert "not a causal language model" in one_line_model_error(vit)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    assert "cannot read" in one_line_model_error(garbage)
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(model_dir / name, no_tok / name)
    assert "no tokenizer" in one_line_model_error(no_tok)
    with pytest.raises(ModelError, match="no tokenizer"):
        load_tokenizer(no_tok)
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    assert "weights" in one_line_model_error(no_weights)


def test_default_model_dir_honours_cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EARL_STREAM_CACHE", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "tictactoe-warm-v4"
    # another warm start is another model: never the cached default under a different setting
    assert default_model_dir(warm_start_steps=450) == tmp_path / "models" / "tictactoe-warm-v4-450steps"
    assert default_model_dir(warm_start_steps=RunConfig().model.warm_start_steps) == default_model_dir()
    monkeypatch.delenv("EARL_STREAM_CACHE")
    assert default_model_dir() == Path.home() / ".cache" / "earl_stream" / "models" / "tictactoe-warm-v4"


def test_ensure_default_model_builds_once_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EARL_STREAM_CACHE", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_default_model(warm_start_seconds=0.5))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    final = default_model_dir()
    assert results == [final, final]
    meta = json.loads((final / "earl_stream_model.json").read_text())
    assert meta["name"] == "tictactoe-warm-v4" and meta["warm_start"]["steps"] >= 1
    # Only the finished model and the lock remain: no half-written build directories.
    assert sorted(p.name for p in final.parent.iterdir()) == [".tictactoe-warm-v4.lock", "tictactoe-warm-v4"]
    assert final.stat().st_mode & 0o777 == 0o755
    load_model(final)
    stamp = (final / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == final
    assert (final / "model.safetensors").stat().st_mtime_ns == stamp
