"""SFT (`earl_stream.sft`): the assistant-only mask, malformed transcript files, and a step under dp2 /
fsdp2 / sp2 equal to one process (SGD lr=1, no clipping: the weight change is minus the gradient)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "six, i think"}]


def _chats(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"what is {i} plus {i * 3 % 7}?"},
             {"role": "assistant", "content": str(i + i * 3 % 7) * (1 + i % 4)},
             {"role": "user", "content": "sure?" * (i % 3)}, {"role": "assistant", "content": "yes"}]
            for i in range(n)]


def test_mask_covers_exactly_the_assistant_tokens(tiny_model_dir: Path) -> None:
    from earl_stream.model.chat import ChatFormat
    from earl_stream.model.loading import load_tokenizer
    from earl_stream.sft import tokenize_chat

    tok = load_tokenizer(tiny_model_dir)
    fmt = ChatFormat(tok)
    ex = tokenize_chat(tok, CHAT)
    # the tokens are the whole chat template rendering
    full = tok.encode(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)
    assert ex.input_ids.tolist() == list(full)
    # the masked spans are, in order, each assistant content followed by its end-of-turn token
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    assistant = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert len(spans) == len(assistant)
    for span, text in zip(spans, assistant):
        assert span[-1] == fmt.end_token_id
        assert tok.decode(span[:-1]) == text
    # nothing else: the count is exactly those tokens
    assert ex.loss_tokens == sum(len(tok.encode(a, add_special_tokens=False)) + 1 for a in assistant)


def test_malformed_line_is_refused_with_its_number(tmp_path: Path) -> None:
    from earl_stream.sft import TranscriptError, load_transcripts

    good = json.dumps({"messages": CHAT})
    path = tmp_path / "t.jsonl"
    path.write_text(good + "\n\n" + good + "\n{not json\n")
    with pytest.raises(TranscriptError, match=r"t.jsonl:4: not valid JSON"):
        load_transcripts(path)
    path.write_text(good + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(TranscriptError, match=r"t.jsonl:2: no assistant message"):
        load_transcripts(path)
    path.write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    with pytest.raises(TranscriptError, match=r"t.jsonl:1: message 0"):
        load_transcripts(path)


def test_cli_refuses_a_malformed_file(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from earl_stream.cli.main import main

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n[1, 2]\n")
    assert main(["sft", "--model", str(tiny_model_dir), "--data", str(path), "--out", str(tmp_path / "o")]) != 0
    assert "bad.jsonl:2" in capsys.readouterr().err


PLANS = [("dp2", dict(dp=2)), ("fsdp2", dict(fsdp=2)), ("sp2", dict(sp=2)), ("fsdp2_mb64", dict(fsdp=2, micro_batch_tokens=64))]


def _step(model_dir: str, cfg: Any, rank: int = 0, world: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.model.chat import ChatFormat
    from earl_stream.model.loading import load_model
    from earl_stream.sft import sft_step, tokenize_chat
    from earl_stream.sft.loop import place_model

    model, tok = load_model(model_dir)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    fmt = ChatFormat(tok)
    examples = [tokenize_chat(tok, c, fmt) for c in _chats(7)]
    placement = place_model(model, cfg, rank=rank, world=world)
    res = sft_step(model, torch.optim.SGD(model.parameters(), lr=1.0), examples, placement,
                   micro_batch_tokens=cfg.micro_batch_tokens, context_weight=cfg.context_weight, grad_clip=0.0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return res.loss, {k: full[k].detach() - init[k] for k in init}


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from earl_stream.sft import SFTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {name: _step(model_dir, SFTConfig(context_weight=0.3, **kw), rank, world) for name, kw in PLANS}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_step_under_dp2_fsdp2_sp2_equals_one_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    from earl_stream.sft import SFTConfig

    ref_loss, ref = _step(str(tiny_model_dir), SFTConfig(context_weight=0.3, micro_batch_tokens=1 << 20))
    from spawned_ranks import free_port  # the rendezvous port, outside the ephemeral range

    port = free_port()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    out = str(tmp_path / "r")
    mp.start_processes(_worker, args=(2, port, str(tiny_model_dir), out), nprocs=2, join=True, start_method="spawn")
    scale = max(float(d.abs().max()) for d in ref.values())
    assert scale > 1e-4
    for rank in range(2):
        results = torch.load(f"{out}.{rank}")
        for name, _ in PLANS:
            loss, delta = results[name]
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, rank)
            worst = max(float((delta[k] - ref[k]).abs().max()) for k in ref)
            assert worst <= 1e-5 * scale, f"{name} rank {rank}: {worst:.3g} vs {scale:.3g}"


def test_loss_is_the_assistant_token_cross_entropy(tiny_model_dir: Path) -> None:
    """The step's reported loss is the mean next-token cross-entropy over the masked tokens, by hand."""
    from earl_stream.model.chat import ChatFormat
    from earl_stream.model.loading import load_model
    from earl_stream.sft import SFTConfig, sft_step, tokenize_chat
    from earl_stream.sft.loop import place_model

    model, tok = load_model(tiny_model_dir)
    fmt = ChatFormat(tok)
    examples = [tokenize_chat(tok, c, fmt) for c in _chats(3)]
    nll, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.from_numpy(e.input_ids.astype(np.int64))[None]
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            m = torch.from_numpy(e.loss_mask[1:]).bool()
            nll -= float(lp[m].sum())
            count += int(m.sum())
    cfg = SFTConfig()
    res = sft_step(model, torch.optim.SGD(model.parameters(), lr=0.0), examples, place_model(model, cfg))
    assert res.loss == pytest.approx(nll / count, rel=1e-5)
    assert res.loss_tokens == count
