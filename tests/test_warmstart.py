"""Warm start: synthetic transcripts match the agent loop's rendering, and a short run learns and saves."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from earl_stream.chat import ChatFormat
from earl_stream.modeling import init_model, load_model, load_tokenizer
from earl_stream.warmstart import WarmStartReport, evaluate_tictactoe, synthetic_episode, warm_start
from envs.tictactoe import TicTacToe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("warm") / "m", seed=0)


def test_synthetic_episode_is_the_chat_rendering_of_a_legal_game(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    fmt = ChatFormat(tok)
    for seed in range(20):
        ids, mask = synthetic_episode(fmt, tok, seed, random.Random(seed))
        assert len(ids) == len(mask)
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
    report = warm_start(model_dir, seconds=60, seed=0, batch_size=4, max_steps=24, eval_games=8)
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
    first = evaluate_tictactoe(model, tok, games=6, seed=3)
    assert first == evaluate_tictactoe(model, tok, games=6, seed=3)
    assert all(0.0 <= x <= 1.0 for x in first)
