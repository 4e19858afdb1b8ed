"""Supervised warm start of a tiny model on synthetic transcripts of legal Tic-Tac-Toe play.

RL from a random init cannot learn the game on these machines (FACTS.md); real users start from a
pretrained model that already knows the format and the rules. This module owns the analog: play
games in which X picks uniformly random legal moves, render them token for token exactly as the
agent loop will (`ChatFormat`), train cross-entropy on the model's own tokens only (move + end
token), then measure legality and win rate by sampling at temperature 1.0. After it, the model
plays near the random-legal level (~0.58 wins as X), which RL must then improve on.
Building the model is `earl_stream.modeling`'s job; the agent loop and engines live elsewhere.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from earl_stream.chat import ChatFormat
from earl_stream.env import StepResult
from earl_stream.modeling import load_model
from envs.tictactoe import TicTacToe

__all__ = ["WarmStartReport", "warm_start", "synthetic_episode", "evaluate_tictactoe"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_WARMUP_STEPS = 20
_MIN_LR_FRACTION = 0.1
_DECAY_FRACTION = 0.3
_EVAL_SEED_BASE = 1_000_000_007  # far from the training seeds, so evaluation games are fresh


@dataclass(frozen=True)
class WarmStartReport:
    """Outcome of `warm_start`.

    steps: optimizer steps taken; first_loss / final_loss: mean cross-entropy (nats per trained
    token) over the first / last min(10, steps // 4) steps (at least one); games_trained: synthetic games seen;
    train_seconds / eval_seconds: wall time of each phase; tokens_per_game: mean episode length in
    tokens; legal_rate: legal model moves / moves attempted; win_rate, draw_rate: fractions of the
    `eval_games` evaluation games (an illegal move is a loss).
    """

    steps: int
    first_loss: float
    final_loss: float
    games_trained: int
    train_seconds: float
    tokens_per_game: float
    legal_rate: float
    win_rate: float
    draw_rate: float
    eval_games: int
    eval_seconds: float

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-able dict."""
        return asdict(self)


def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (TicTacToe's methods), without an event loop.

    Works inside a running event loop too, where asyncio.run would refuse.
    """
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the environment suspended; warm start needs one that never awaits")


def synthetic_episode(
    fmt: ChatFormat, tokenizer: PreTrainedTokenizerBase, seed: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """One game with X playing uniformly random legal moves, rendered as the agent loop renders it.

    Returns (input_ids, loss_mask), equal-length int lists; the mask is 1 on X's move tokens and
    its end-of-turn token, 0 on prompts and observations.
    """
    env = TicTacToe()
    ids = fmt.first_turn(env.system_prompt, _drive(env.reset(seed)))
    mask = [0] * len(ids)
    while True:
        move = rng.choice(env.legal_moves())
        reply = list(tokenizer.encode(str(move), add_special_tokens=False)) + [fmt.end_token_id]
        ids += reply
        mask += [1] * len(reply)
        result: StepResult = _drive(env.step(str(move)))
        if result.done:
            return ids, mask
        nxt = fmt.next_turn(result.observation)
        ids += nxt
        mask += [0] * len(nxt)


def _batch(
    fmt: ChatFormat, tokenizer: PreTrainedTokenizerBase, rng: random.Random, size: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` synthetic games right-padded: input_ids [B, T] int64 and loss_mask [B, T] bool."""
    episodes = [synthetic_episode(fmt, tokenizer, rng.getrandbits(31), rng) for _ in range(size)]
    width = max(len(ids) for ids, _ in episodes)
    input_ids = torch.full((size, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((size, width), dtype=torch.bool)
    for row, (ids, mask) in enumerate(episodes):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        loss_mask[row, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return input_ids, loss_mask


def _losses(
    model: PreTrainedModel, input_ids: torch.Tensor, loss_mask: torch.Tensor, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy: (mean over model-token targets, mean over other real targets)."""
    # Right padding needs no attention mask: causal attention never looks ahead at the pads.
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    own = loss_mask[:, 1:]
    other = (targets != pad_id) & ~own
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return per_token[own].mean(), per_token[other].mean()


def _lr_factor(step: int, progress: float) -> float:
    """Linear warmup, constant, then linear decay to _MIN_LR_FRACTION over the last _DECAY_FRACTION.

    `progress` in [0, 1] is the fraction of the budget (time or steps) used so far. A long constant
    phase matters here: the model sits on a plateau (uniform over digits) until it learns to read
    the board, and an early decay stretches that plateau.
    """
    warm = min(1.0, (step + 1) / _WARMUP_STEPS)
    decay = min(1.0, max(0.0, (progress - (1.0 - _DECAY_FRACTION)) / _DECAY_FRACTION))
    return warm * (1.0 - (1.0 - _MIN_LR_FRACTION) * decay)


def warm_start(
    model_dir: str | os.PathLike[str],
    *,
    seconds: float = 90,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 16,
    max_steps: int | None = None,
    eval_games: int = 100,
    observation_weight: float = 0.3,
) -> WarmStartReport:
    """Train the model in `model_dir` on synthetic legal play for `seconds` of wall time, save it back.

    Stops at `seconds` or `max_steps`, whichever comes first (`max_steps` makes a run reproducible
    for a seed). The loss is the cross-entropy on the model's own tokens (move + end token) plus
    `observation_weight` times the cross-entropy on the prompt/observation tokens: predicting the
    boards teaches the tiny model to read them, without which it stays on the "any digit" plateau
    (legal moves ~0.83 after 1,300 steps with weight 0 vs ~0.95 after ~300 steps with 0.3). The
    reported losses are on the model's own tokens only. Then plays `eval_games` games at
    temperature 1.0 (0 skips the evaluation; rates are then NaN). Thread count is the caller's
    (`torch.set_num_threads`).
    """
    model, tokenizer = load_model(model_dir)
    fmt = ChatFormat(tokenizer)
    pad_id = int(tokenizer.pad_token_id)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    losses: list[float] = []
    tokens = games = 0
    start = time.monotonic()
    while max_steps is None or len(losses) < max_steps:
        elapsed = time.monotonic() - start
        if elapsed >= seconds:
            break
        progress = max(elapsed / seconds if seconds > 0 else 1.0,
                       len(losses) / max_steps if max_steps else 0.0)
        for group in optimizer.param_groups:
            group["lr"] = lr * _lr_factor(len(losses), progress)
        input_ids, loss_mask = _batch(fmt, tokenizer, rng, batch_size, pad_id)
        loss, observation_loss = _losses(model, input_ids, loss_mask, pad_id)
        optimizer.zero_grad(set_to_none=True)
        (loss + observation_weight * observation_loss if observation_weight else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        games += batch_size
        tokens += int((input_ids != pad_id).sum())
        if len(losses) % 50 == 0:
            logger.info("warm start step %d loss %.4f (%.0f s)", len(losses), losses[-1], elapsed)
    train_seconds = time.monotonic() - start
    model.eval()
    model.save_pretrained(model_dir)
    start = time.monotonic()
    legal, win, draw = evaluate_tictactoe(model, tokenizer, games=eval_games, seed=seed)
    window = max(1, min(10, len(losses) // 4))
    report = WarmStartReport(
        steps=len(losses),
        first_loss=_mean(losses[:window]),
        final_loss=_mean(losses[-window:]),
        games_trained=games,
        train_seconds=round(train_seconds, 2),
        tokens_per_game=tokens / games if games else float("nan"),
        legal_rate=legal,
        win_rate=win,
        draw_rate=draw,
        eval_games=eval_games,
        eval_seconds=round(time.monotonic() - start, 2),
    )
    logger.info("warm start done: %s", report)
    return report


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class _Game:
    """One evaluation game: its env, its tokens so far, and the current turn's sampled tokens."""

    def __init__(self, fmt: ChatFormat, seed: int) -> None:
        self.env = TicTacToe()
        self.ids = fmt.first_turn(self.env.system_prompt, _drive(self.env.reset(seed)))
        self.reply: list[int] = []
        self.outcome = ""


@torch.no_grad()
def evaluate_tictactoe(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, games: int = 100, seed: int = 0,
    temperature: float = 1.0,
) -> tuple[float, float, float]:
    """Play `games` games as X by sampling from `model`; return (legal_rate, win_rate, draw_rate).

    Plain batched forward passes over the whole history (no KV cache): [B, T] int64 in, logits of
    each game's last position out. A turn ends at a stop token or after the env's max_turn_tokens;
    an illegal move ends the game as a loss. legal_rate = legal moves / moves attempted.
    """
    if games <= 0:
        return float("nan"), float("nan"), float("nan")
    fmt = ChatFormat(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    pad_id = int(tokenizer.pad_token_id)
    active = [_Game(fmt, _EVAL_SEED_BASE + seed * games + i) for i in range(games)]
    finished: list[_Game] = []
    moves = illegal = 0
    while active:
        width = max(len(g.ids) + len(g.reply) for g in active)
        batch = torch.full((len(active), width), pad_id, dtype=torch.long)
        for row, g in enumerate(active):
            seq = g.ids + g.reply
            batch[row, : len(seq)] = torch.tensor(seq)
        last = torch.tensor([len(g.ids) + len(g.reply) - 1 for g in active])
        logits = model(input_ids=batch).logits[torch.arange(len(active)), last].float()
        sampled = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen)
        still: list[_Game] = []
        for g, token in zip(active, sampled[:, 0].tolist()):
            g.reply.append(int(token))
            if token not in fmt.stop_token_ids and len(g.reply) < g.env.max_turn_tokens:
                still.append(g)
                continue
            moves += 1
            result = _drive(g.env.step(fmt.reply_text(g.reply)))
            if token not in fmt.stop_token_ids:
                g.reply.append(fmt.end_token_id)  # close a turn cut at max_turn_tokens
            g.ids += g.reply
            g.reply = []
            if result.done:
                g.outcome = str(result.info.get("outcome", ""))
                illegal += g.outcome == "illegal"
                finished.append(g)
            else:
                g.ids += fmt.next_turn(result.observation)
                still.append(g)
        active = still
    wins = sum(g.outcome == "win" for g in finished)
    draws = sum(g.outcome == "draw" for g in finished)
    return (moves - illegal) / moves, wins / games, draws / games
