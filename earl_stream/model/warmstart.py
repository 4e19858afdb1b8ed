"""Supervised warm start of a tiny model on synthetic transcripts of legal play of a board game.

RL from a random init cannot learn Tic-Tac-Toe on these machines (FACTS.md); real users start from a
pretrained model that already knows the format and the rules. This module owns the analog: play
games of `game` (any environment with `legal_moves()`, see `Game`) in which the model's side picks
uniformly random legal moves, render them token for token exactly as the agent loop will
(`ChatFormat`), train cross-entropy on the model's own tokens only (move + end token), then measure
legality and win rate by sampling at temperature 1.0. For Tic-Tac-Toe the model then plays near the
random-legal level (~0.58 wins as X), which RL must improve on. The game is a parameter: the
framework names no environment; building the model is `earl_stream.model.tiny`'s job.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from earl_stream.env import StepResult, resolve_env
from earl_stream.env.images import observation_text
from earl_stream.errors import EnvError
from earl_stream.model.chat import ChatFormat
from earl_stream.model.loading import load_model
from earl_stream.sft.data import Example
from earl_stream.sft.loop import SFTConfig, place_model, run_sft
from earl_stream.workers.packed_attention import strip_run_state

__all__ = ["Game", "GameFactory", "WarmStartReport", "evaluate_game", "resolve_game", "synthetic_episode", "warm_start"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_WARMUP_STEPS = 20
_MIN_LR_FRACTION = 0.1
_DECAY_FRACTION = 0.3
_EVAL_SEED_BASE = 1_000_000_007  # far from the training seeds, so evaluation games are fresh


class Game(Protocol):
    """A turn-based game the warm start can play: an environment whose methods never suspend.

    `reset(seed)` / `step(text)` as in `earl_stream.env.Environment` (coroutines that never await),
    `legal_moves()` the moves the model's side may play now (each sent to `step` as `str(move)`),
    `system_prompt` and `max_turn_tokens` as the agent loop reads them, and on the terminal step
    `info["outcome"]` in {"win", "draw", "loss", "illegal"} from the model's side.
    """

    system_prompt: str
    max_turn_tokens: int

    async def reset(self, seed: int) -> str: ...

    async def step(self, action_text: str) -> StepResult: ...

    def legal_moves(self) -> list[int]: ...


GameFactory = Callable[[], Game]


def resolve_game(game: str | GameFactory) -> GameFactory:
    """A game factory from an environment spec (see `earl_stream.env`) or a factory; checks the protocol."""
    factory: Any = resolve_env(game) if isinstance(game, str) else game
    probe = factory()
    if not callable(getattr(probe, "legal_moves", None)):
        raise EnvError(f"{type(probe).__name__} has no legal_moves(); the warm start plays only games that list them")
    return factory


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
    """Run a coroutine that never suspends (a `Game`'s methods), without an event loop.

    Works inside a running event loop too, where asyncio.run would refuse.
    """
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("the environment suspended; warm start needs one that never awaits")


def synthetic_episode(
    fmt: ChatFormat, tokenizer: PreTrainedTokenizerBase, seed: int, rng: random.Random, game: GameFactory
) -> tuple[list[int], list[int]]:
    """One game with the model's side playing uniformly random legal moves, rendered as the agent loop does.

    Returns (input_ids, loss_mask), equal-length int lists; the mask is 1 on the model's move tokens
    and its end-of-turn token, 0 on prompts and observations.
    """
    env = game()
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
        nxt = fmt.next_turn(observation_text(result.observation))
        ids += nxt
        mask += [0] * len(nxt)


def _examples(fmt: ChatFormat, tokenizer: PreTrainedTokenizerBase, rng: random.Random, size: int,
              game: GameFactory) -> list[Example]:
    """`size` synthetic games as SFT examples (mask 1 on the model's own tokens)."""
    out = []
    for _ in range(size):
        ids, mask = synthetic_episode(fmt, tokenizer, rng.getrandbits(31), rng, game)
        out.append(Example(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    return out


def warm_start(
    model_dir: str | os.PathLike[str],
    game: str | GameFactory,
    *,
    seconds: float = 90,
    seed: int = 0,
    lr: float = 3e-3,
    batch_size: int = 16,
    max_steps: int | None = None,
    eval_games: int = 100,
    observation_weight: float = 0.3,
) -> WarmStartReport:
    """Train the model in `model_dir` on synthetic legal play of `game` for `seconds`, save it back.

    `game`: an environment spec (e.g. "tictactoe") or a factory of `Game`s.

    Stops at `seconds` or `max_steps`, whichever comes first (`max_steps` makes a run reproducible
    for a seed). The loss is the cross-entropy on the model's own tokens (move + end token) plus
    `observation_weight` times the cross-entropy on the prompt/observation tokens: predicting the
    boards teaches the tiny model to read them, without which it stays on the "any digit" plateau
    (legal moves ~0.83 after 1,300 steps with weight 0 vs ~0.95 after ~300 steps with 0.3). The
    reported losses are on the model's own tokens only. Then plays `eval_games` games at
    temperature 1.0 (0 skips the evaluation; rates are then NaN). Thread count is the caller's
    (`torch.set_num_threads`).
    """
    factory = resolve_game(game)
    model, tokenizer = load_model(model_dir)
    fmt = ChatFormat(tokenizer)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cfg = SFTConfig(lr=lr, beta2=0.98, batch_size=batch_size, seconds=seconds, warmup_steps=_WARMUP_STEPS,
                    decay_fraction=_DECAY_FRACTION, min_lr_ratio=_MIN_LR_FRACTION, context_weight=observation_weight,
                    grad_clip=1.0, micro_batch_tokens=1 << 20, seed=seed)
    # the shared SFT loop (earl_stream.sft), on fresh games every step
    sft = run_sft(model, tokenizer, lambda _step: _examples(fmt, tokenizer, rng, batch_size, factory), cfg,
                  place_model(model, cfg), steps=max_steps if max_steps is not None else 1 << 62)
    model.eval()
    strip_run_state(model)
    model.save_pretrained(model_dir)
    start = time.monotonic()
    legal, win, draw = evaluate_game(model, tokenizer, factory, games=eval_games, seed=seed)
    games = sft.examples
    report = WarmStartReport(
        steps=sft.steps,
        first_loss=sft.first_loss,
        final_loss=sft.final_loss,
        games_trained=games,
        train_seconds=sft.train_seconds,
        tokens_per_game=sft.tokens / games if games else float("nan"),
        legal_rate=legal,
        win_rate=win,
        draw_rate=draw,
        eval_games=eval_games,
        eval_seconds=round(time.monotonic() - start, 2),
    )
    logger.info("warm start done: %s", report)
    return report


class _Playing:
    """One evaluation game: its env, its tokens so far, and the current turn's sampled tokens."""

    def __init__(self, fmt: ChatFormat, game: GameFactory, seed: int) -> None:
        self.env = game()
        self.ids = fmt.first_turn(self.env.system_prompt, _drive(self.env.reset(seed)))
        self.reply: list[int] = []
        self.outcome = ""


@torch.no_grad()
def evaluate_game(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, game: GameFactory, *, games: int = 100,
    seed: int = 0, temperature: float = 1.0,
) -> tuple[float, float, float]:
    """Play `games` games of `game` by sampling from `model`; return (legal_rate, win_rate, draw_rate).

    Plain batched forward passes over the whole history (no KV cache): [B, T] int64 in, logits of
    each game's last position out. A turn ends at a stop token or after the env's max_turn_tokens;
    an illegal move ends the game as a loss. legal_rate = legal moves / moves attempted.
    """
    if games <= 0:
        return float("nan"), float("nan"), float("nan")
    fmt = ChatFormat(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    pad_id = int(tokenizer.pad_token_id)
    active = [_Playing(fmt, game, _EVAL_SEED_BASE + seed * games + i) for i in range(games)]
    finished: list[_Playing] = []
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
        still: list[_Playing] = []
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
                g.ids += fmt.next_turn(observation_text(result.observation))
                still.append(g)
        active = still
    wins = sum(g.outcome == "win" for g in finished)
    draws = sum(g.outcome == "draw" for g in finished)
    return (moves - illegal) / moves, wins / games, draws / games
