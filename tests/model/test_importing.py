"""`earl-stream model import`: a tiny Llama written as GGUF by the `gguf` package here, imported to an HF
directory that loads back to the same logits and tokens, trained by `up` for 2 steps; one clear error per
bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from earl_stream.errors import ModelError
from earl_stream.model import CHAT_TEMPLATE, import_model, init_model, load_model, load_tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'earl_stream[real-model]')")
pytest.importorskip("accelerate", reason="transformers needs accelerate to read GGUF files")

torch.set_num_threads(1)
TEXTS = ["X O 3\n4 X 6\n7 8 O", "What is 12 + 30? (hello) don't 1234!", "café naïve ✓", '{"a": [1, 2]}']


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert script stores q/k rows interleaved for its rotary layout; transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, tokenizer_dir: Path, model: LlamaForCausalLM, *, arch: str = "llama",
               chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Write `model` (a Llama) and the byte-level BPE tokenizer in `tokenizer_dir` as llama.cpp does."""
    cfg = model.config
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokenizer = load_tokenizer(tokenizer_dir)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("earl tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # the tiny tokenizer splits text with Qwen2's regex
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])  # 3 = control, 1 = normal
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    w.add_unk_token_id(tokenizer.pad_token_id)  # SmolLM2 has one; transformers keeps it as an unknown config field
    if chat_template is not None:
        w.add_chat_template(chat_template)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[pre + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[pre + "self_attn.k_proj.weight"], kv_heads))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[pre + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("gguf")
    tok_dir = init_model(root / "tok", seed=0)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=False, initializer_range=0.1)).eval()
    path = write_gguf(root / "tiny-llama.gguf", tok_dir, llama)
    return {"root": root, "tok_dir": tok_dir, "llama": llama, "gguf": path}


@pytest.fixture(scope="module")
def imported(tiny: dict[str, Any]) -> Path:
    out = tiny["root"] / "imported"
    report = import_model(tiny["gguf"], out)
    assert (report.source_format, report.model_type, report.vocab_size) == ("gguf", "llama", 512)
    assert report.parameters == sum(p.numel() for p in tiny["llama"].parameters())
    return out


def test_gguf_round_trips_to_the_same_hf_model(tiny: dict[str, Any], imported: Path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", "earl_stream_model.json"} <= {
        p.name for p in imported.iterdir()}
    model, tok = load_model(imported)
    assert type(model).__name__ == "LlamaForCausalLM" and next(model.parameters()).dtype == torch.float32
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in imported.iterdir())  # shared, like the default model
    saved = json.loads((imported / "config.json").read_text())
    assert not {"quantization_config", "_model_name_or_path", "unk_token_id"} & set(saved)
    original = load_tokenizer(tiny["tok_dir"])
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False), text
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "1 2 3"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        original.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([original.encode(TEXTS[0] + TEXTS[1], add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, tiny["llama"](input_ids=ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_an_hf_directory_imports_too(tmp_path: Path, imported: Path) -> None:
    report = import_model(imported, tmp_path / "again")
    assert report.source_format == "hf"
    a, _ = load_model(imported)
    b, _ = load_model(tmp_path / "again")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_unsupported_gguf_architecture_is_one_clear_error(tiny: dict[str, Any], tmp_path: Path) -> None:
    bad = write_gguf(tmp_path / "odd.gguf", tiny["tok_dir"], tiny["llama"], arch="earltestarch")
    with pytest.raises(ModelError) as info:
        import_model(bad, tmp_path / "out")
    message = str(info.value)
    assert str(bad) in message and "'earltestarch'" in message and "cannot load" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_missing_chat_template_is_one_clear_error(tiny: dict[str, Any], tmp_path: Path) -> None:
    bare = write_gguf(tmp_path / "bare.gguf", tiny["tok_dir"], tiny["llama"], chat_template=None)
    with pytest.raises(ModelError, match=r"bare\.gguf has no tokenizer\.chat_template.*--chat-template"):
        import_model(bare, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["bare.gguf"]
    report = import_model(bare, tmp_path / "out", chat_template=CHAT_TEMPLATE)
    assert load_tokenizer(report.out_dir).chat_template == CHAT_TEMPLATE


def test_bad_directories_are_one_clear_error_each(tmp_path: Path, imported: Path) -> None:
    no_template = tmp_path / "no_template"
    shutil.copytree(imported, no_template)
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((no_template / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=f"tokenizer in {no_template} has no chat template"):
        import_model(no_template, tmp_path / "out1")
    with pytest.raises(ModelError, match="no chat template"):
        load_model(no_template)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(imported / name, no_tokenizer / name)
    with pytest.raises(ModelError, match=f"{no_tokenizer} has no tokenizer"):
        import_model(no_tokenizer, tmp_path / "out2")
    with pytest.raises(ModelError, match="does not exist"):
        import_model(tmp_path / "nope.gguf", tmp_path / "out3")
    with pytest.raises(ModelError, match="already exists and is not empty; pass --overwrite"):
        import_model(imported, no_tokenizer)
    assert not any((tmp_path / f"out{i}").exists() for i in (1, 2, 3))


def test_too_large_for_the_memory_budget(tiny: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"tiny-llama\.gguf has 0\.00B parameters: .* needs about .* GiB of memory"):
        import_model(tiny["gguf"], tmp_path / "out", memory_budget_bytes=1000)


def test_cli_model_import(tiny: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "earl_stream", "model", "import", str(tiny["gguf"]), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"model.path={out}" in proc.stdout and json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])["parameters"]
    again = subprocess.run([sys.executable, "-m", "earl_stream", "model", "import", str(tiny["gguf"]), str(out)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].startswith("earl-stream model: error: ")
    assert "--overwrite" in again.stderr


@pytest.mark.live
def test_up_trains_the_imported_model_for_two_steps(tmp_path: Path, imported: Path) -> None:
    summary = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", "2", "--summary", str(summary),
           f"model.path={imported}", f"run_dir={tmp_path / 'run'}", "trainer.groups_per_step=2",
           "trainer.group_size=2", "rollout.workers=1", "rollout.groups_in_flight=2", "supervisor.heartbeat_s=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert result["policy_version"] >= 2 and result["samples_trained"] >= 2 * 2 * 2
