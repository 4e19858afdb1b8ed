"""Warm start: synthetic transcripts match the agent loop's rendering, and a short run learns and saves;
the game is a parameter (an env spec or a factory), so the framework names no environment."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from earl_stream_envs.connect_four import ConnectFour
from earl_stream_envs.tictactoe import TicTacToe

from earl_stream.errors import EnvError
from earl_stream.model import init_model, load_model, load_tokenizer
from earl_stream.model.chat import ChatFormat
from earl_stream.model.warmstart import WarmStartReport, evaluate_game, resolve_game, synthetic_episode, warm_start

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("warm") / "m", seed=0)


def test_synthetic_episode_is_the_chat_rendering_of_a_legal_game(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    fmt = ChatFormat(tok)
    for seed in range(20):
        ex = synthetic_episode(fmt, tok, seed, random.Random(seed), TicTacToe)
        ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
        assert len(ids) == len(mask) and ex.images == ()
        trained = [i for i, m in zip(ids, mask) if m]
        assert trained[1::2] == [fmt.end_token_id] * (len(trained) // 2)
        moves = [tok.decode([i]) for i in trained[0::2]]
        # Replaying the moves against the same opponent seed is a legal game that ends exactly there.
        env = TicTacToe()
        messages = [{"role": "system", "content": env.system_prompt},
                    {"role": "user", "content": asyncio.run(env.reset(seed))}]
        for n, move in enumerate(moves):
            assert int(move) in env.legal_moves()
            result = asyncio.run(env.step(move))
            messages.append({"role": "assistant", "content": move})
            assert result.done == (n == len(moves) - 1)
            if not result.done:
                messages.append({"role": "user", "content": result.observation})
        assert result.info["outcome"] in {"win", "draw", "loss"}
        text = tok.apply_chat_template(messages, tokenize=False)
        full = tok.encode(text, add_special_tokens=False)
        assert full[: len(ids)] == ids and tok.decode(full[len(ids):]) == "\n"


def test_short_warm_start_lowers_loss_and_saves(model_dir: Path) -> None:
    before, _ = load_model(model_dir)
    report = warm_start(model_dir, "tictactoe", seconds=60, seed=0, batch_size=4, max_steps=24, eval_games=8)
    assert isinstance(report, WarmStartReport)
    assert report.steps == 24 and report.games_trained == 96
    assert report.final_loss < report.first_loss - 0.5
    assert 60 < report.tokens_per_game < 200
    assert 0.0 <= report.legal_rate <= 1.0 and 0.0 <= report.win_rate <= 1.0
    after, _ = load_model(model_dir)
    diff = sum((a - b).abs().sum().item() for a, b in zip(after.parameters(), before.parameters()))
    assert diff > 0
    assert set(report.as_dict()) >= {"steps", "final_loss", "legal_rate", "win_rate"}


def test_evaluation_is_seeded(model_dir: Path) -> None:
    model, tok = load_model(model_dir)
    first = evaluate_game(model, tok, TicTacToe, games=6, seed=3)
    assert first == evaluate_game(model, tok, TicTacToe, games=6, seed=3)
    assert all(0.0 <= x <= 1.0 for x in first)


def test_the_game_is_a_parameter(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    ex = synthetic_episode(ChatFormat(tok), tok, 0, random.Random(0), resolve_game("connect_four"))
    assert ex.loss_tokens >= 8  # at least 4 moves, each a column digit + end token
    model, _ = load_model(model_dir)
    legal, win, draw = evaluate_game(model, tok, ConnectFour, games=2, seed=0)
    assert 0.0 <= legal <= 1.0 and 0.0 <= win + draw <= 1.0
    with pytest.raises(EnvError, match="legal_moves"):
        resolve_game("calculator")


def test_the_framework_does_not_import_envs() -> None:
    import subprocess
    import sys

    code = ("import sys, earl_stream.model, earl_stream.model, earl_stream.model.warmstart; "
            "print(sorted(m for m in sys.modules if m == 'envs' or m.startswith('envs.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_the_default_model_ships_with_the_package(tmp_path, monkeypatch, caplog) -> None:
    """A fresh machine gets the default model from the package (no minutes of warm start before the first step):
    the shipped build is the current recipe's, unpacks whole, and loads through from_pretrained."""
    import json
    import logging

    from transformers import AutoModelForCausalLM

    from earl_stream.model import default as default_model

    monkeypatch.setenv("EARL_STREAM_CACHE", str(tmp_path))
    assert default_model.packaged_model(default_model.DEFAULT_MODEL_NAME) is not None, "the default model is not shipped"
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        built = default_model.ensure_default_model()
    assert built == tmp_path / "models" / default_model.DEFAULT_MODEL_NAME
    assert "copied from the package" in caplog.text
    meta = json.loads((built / "earl_stream_model.json").read_text())
    assert meta["name"] == default_model.DEFAULT_MODEL_NAME
    assert meta["warm_start"]["steps"] == default_model.DEFAULT_WARM_START_STEPS
    model = AutoModelForCausalLM.from_pretrained(built)
    assert sum(p.numel() for p in model.parameters()) > 1_000_000
