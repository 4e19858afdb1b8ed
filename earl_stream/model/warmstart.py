"""Supervised warm start of a tiny model on synthetic transcripts of legal play of a board game.

RL from a random init cannot learn Tic-Tac-Toe on these machines (FACTS.md); real users start from a
pretrained model that already knows the format and the rules. This module owns the analog: play
games of `game` (any environment with `legal_moves()`, see `Game`) in which the model's side picks
uniformly random legal moves, render them token for token exactly as the agent loop will
(`ChatFormat`), train cross-entropy on the model's own tokens only (move + end token), then measure
legality and win rate by sampling at temperature 1.0. For Tic-Tac-Toe the model then plays near the
random-legal level (~0.58 wins as X), which RL must improve on. The game is a parameter: the
framework names no environment; building the model is `earl_stream.model.tiny`'s job.

A vision-language model (a directory `load_policy` finds a processor in) plays games whose observations are
pictures (`tictactoe_image`): its turns are rendered by `model.vision.VisionChat` as the agent loop renders them,
each picture a span of the processor's image tokens, and the training and evaluation forwards merge the pictures
(`workers.vision_inputs.VisionInputs`); the loss is the same, an image's placeholder tokens excepted. Random
legal play alone does not teach a tiny model to read a picture: the move loss stays at the uniform-over-9 plateau
(1.08 nats a token after 650 steps), as nothing in the transcript names a cell. So each step also trains as many
captions (`caption_example`): a picture of a position reached by random play, the prompt "Describe the board."
and the game's text board as the reply (`render()`, e.g. "X O 3\n4 X 6\n7 8 O"), which names each empty cell's
number where it is drawn, as pretraining on captions teaches a real vision-language model to read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from earl_stream.env import Observation, StepResult, resolve_env
from earl_stream.env.api import run_now
from earl_stream.env.images import observation_text, split_observation
from earl_stream.errors import EnvError
from earl_stream.model.chat import ChatFormat
from earl_stream.model.loading import load_policy
from earl_stream.model.vision import VisionChat
from earl_stream.records import SampleImage
from earl_stream.sft.data import Example
from earl_stream.sft.loop import SFTConfig, place_model, run_sft
from earl_stream.workers.packed_attention import strip_run_state
from earl_stream.workers.vision_inputs import BatchImage, VisionInputs

__all__ = ["CAPTION_PROMPT", "Describable", "Game", "GameFactory", "Turns", "WarmStartReport", "caption_example",
           "evaluate_game", "resolve_game", "synthetic_episode", "warm_start"]

logger = logging.getLogger(__name__)

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

    async def reset(self, seed: int) -> str | Observation: ...

    async def step(self, action_text: str) -> StepResult: ...

    def legal_moves(self) -> list[int]: ...


class Describable(Protocol):
    """A game shown as pictures that can also say its state in text (its caption in the warm start)."""

    def render(self) -> str: ...


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
    token) over the first / last min(10, steps // 4) steps (at least one); games_trained: synthetic games seen
    (beside as many captions for a vision-language model);
    train_seconds / eval_seconds: wall time of each phase; tokens_per_game: mean example length in
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


Turns = ChatFormat | VisionChat  # how an episode's turns become tokens: text only, or with pictures


def _first_turn(fmt: Turns, system: str, observation: str | Observation) -> tuple[list[int], list[SampleImage]]:
    if isinstance(fmt, VisionChat):
        return fmt.first_turn(system, observation)
    return fmt.first_turn(system, observation_text(observation)), []


def _next_turn(fmt: Turns, observation: str | Observation, at: int) -> tuple[list[int], list[SampleImage]]:
    """The next turn's ids and its pictures, their spans counted from position `at` of the episode."""
    if not isinstance(fmt, VisionChat):
        return fmt.next_turn(observation_text(observation)), []
    ids, images = fmt.next_turn(observation)
    return ids, [SampleImage(at + img.start, img.tokens, img.image) for img in images]


def synthetic_episode(fmt: Turns, tokenizer: PreTrainedTokenizerBase, seed: int, rng: random.Random,
                      game: GameFactory) -> Example:
    """One game with the model's side playing uniformly random legal moves, rendered as the agent loop does.

    Returns the episode as an `Example`: its loss mask is 1 on the model's move tokens and its end-of-turn token,
    0 on prompts and observations; with a `VisionChat`, its pictures' spans.
    """
    env = game()
    ids, images = _first_turn(fmt, env.system_prompt, run_now(env.reset(seed)))
    mask = [0] * len(ids)
    while True:
        move = rng.choice(env.legal_moves())
        reply = list(tokenizer.encode(str(move), add_special_tokens=False)) + [fmt.end_token_id]
        ids += reply
        mask += [1] * len(reply)
        result: StepResult = run_now(env.step(str(move)))
        if result.done:
            return Example(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), tuple(images))
        nxt, more = _next_turn(fmt, result.observation, len(ids))
        ids += nxt
        images += more
        mask += [0] * len(nxt)


CAPTION_PROMPT = "Describe the board."


def caption_example(fmt: VisionChat, tokenizer: PreTrainedTokenizerBase, seed: int, rng: random.Random,
                    game: GameFactory) -> Example:
    """A picture of a position reached by random legal play (the model's and the opponent's moves), the prompt
    `CAPTION_PROMPT`, and the game's `render()` text as the reply (mask 1 on it and the end-of-turn token)."""
    env = game()
    observation = run_now(env.reset(seed))
    seen = [(observation, cast(Describable, env).render())]
    while True:
        result: StepResult = run_now(env.step(str(rng.choice(env.legal_moves()))))
        if result.done:
            break
        seen.append((result.observation, cast(Describable, env).render()))
    observation, caption = rng.choice(seen)
    _, images = split_observation(observation)
    ids, pictures = fmt.first_turn(env.system_prompt, Observation(CAPTION_PROMPT, images))
    reply = list(tokenizer.encode(caption, add_special_tokens=False)) + [fmt.end_token_id]
    return Example(np.asarray(ids + reply, dtype=np.int32), np.asarray([0] * len(ids) + [1] * len(reply), np.uint8),
                   tuple(pictures))


def _captions(game: GameFactory, fmt: Turns) -> bool:
    """Whether the warm start trains captions: a vision-language model on a game that renders its state as text."""
    return isinstance(fmt, VisionChat) and callable(getattr(game(), "render", None))


def _examples(fmt: Turns, tokenizer: PreTrainedTokenizerBase, rng: random.Random, size: int,
              game: GameFactory, captions: bool = False) -> list[Example]:
    """`size` synthetic games as SFT examples (mask 1 on the model's own tokens); with `captions`, as many
    captions of pictures (`caption_example`)."""
    out = [synthetic_episode(fmt, tokenizer, rng.getrandbits(31), rng, game) for _ in range(size)]
    if captions:
        assert isinstance(fmt, VisionChat)
        out += [caption_example(fmt, tokenizer, rng.getrandbits(31), rng, game) for _ in range(size)]
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

    `game`: an environment spec (e.g. "tictactoe") or a factory of `Game`s; a vision-language model in
    `model_dir` plays it from its pictures (e.g. "tictactoe_image").

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
    policy = load_policy(model_dir)
    model, tokenizer = policy.model, policy.tokenizer
    vision = VisionInputs(policy.processor, model) if policy.processor is not None else None
    fmt: Turns = vision.chat if vision is not None else ChatFormat(tokenizer)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cfg = SFTConfig(lr=lr, beta2=0.98, batch_size=batch_size, seconds=seconds, warmup_steps=_WARMUP_STEPS,
                    decay_fraction=_DECAY_FRACTION, min_lr_ratio=_MIN_LR_FRACTION, context_weight=observation_weight,
                    grad_clip=1.0, micro_batch_tokens=1 << 20, seed=seed)
    # the shared SFT loop (earl_stream.sft), on fresh games every step
    captions = _captions(factory, fmt)
    sft = run_sft(model, tokenizer, lambda _step: _examples(fmt, tokenizer, rng, batch_size, factory, captions), cfg,
                  place_model(model, cfg), steps=max_steps if max_steps is not None else 1 << 62, vision=vision)
    model.eval()
    strip_run_state(model)
    model.save_pretrained(model_dir)
    start = time.monotonic()
    legal, win, draw = evaluate_game(model, tokenizer, factory, games=eval_games, seed=seed, vision=vision)
    games = sft.examples // 2 if captions else sft.examples  # with captions, half the examples are games
    report = WarmStartReport(
        steps=sft.steps,
        first_loss=sft.first_loss,
        final_loss=sft.final_loss,
        games_trained=games,
        train_seconds=sft.train_seconds,
        tokens_per_game=sft.tokens / sft.examples if sft.examples else float("nan"),
        legal_rate=legal,
        win_rate=win,
        draw_rate=draw,
        eval_games=eval_games,
        eval_seconds=round(time.monotonic() - start, 2),
    )
    logger.info("warm start done: %s", report)
    return report


class _Playing:
    """One evaluation game: its env, its tokens and pictures so far, and the current turn's sampled tokens."""

    def __init__(self, fmt: Turns, game: GameFactory, seed: int) -> None:
        self.env = game()
        self.ids, self.images = _first_turn(fmt, self.env.system_prompt, run_now(self.env.reset(seed)))
        self.reply: list[int] = []
        self.outcome = ""


@torch.no_grad()
def evaluate_game(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, game: GameFactory, *, games: int = 100,
    seed: int = 0, temperature: float = 1.0, vision: VisionInputs | None = None,
) -> tuple[float, float, float]:
    """Play `games` games of `game` by sampling from `model`; return (legal_rate, win_rate, draw_rate).

    Plain batched forward passes over the whole history (no KV cache): [B, T] int64 in, logits of
    each game's last position out; a vision-language model (`vision`) sees every picture of its game so far.
    A turn ends at a stop token or after the env's max_turn_tokens;
    an illegal move ends the game as a loss. legal_rate = legal moves / moves attempted.
    """
    if games <= 0:
        return float("nan"), float("nan"), float("nan")
    fmt: Turns = vision.chat if vision is not None else ChatFormat(tokenizer)
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
        pictures = [BatchImage(row, 0, img) for row, g in enumerate(active) for img in g.images]
        with vision.merged(model, pictures) if vision is not None and pictures else contextlib.nullcontext():
            logits = model(input_ids=batch).logits[torch.arange(len(active)), last].float()
        sampled = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=gen)
        still: list[_Playing] = []
        for g, token in zip(active, sampled[:, 0].tolist()):
            g.reply.append(int(token))
            if token not in fmt.stop_token_ids and len(g.reply) < g.env.max_turn_tokens:
                still.append(g)
                continue
            moves += 1
            result = run_now(g.env.step(fmt.reply_text(g.reply)))
            if token not in fmt.stop_token_ids:
                g.reply.append(fmt.end_token_id)  # close a turn cut at max_turn_tokens
            g.ids += g.reply
            g.reply = []
            if result.done:
                g.outcome = str(result.info.get("outcome", ""))
                illegal += g.outcome == "illegal"
                finished.append(g)
            else:
                nxt, more = _next_turn(fmt, result.observation, len(g.ids))
                g.ids += nxt
                g.images += more
                still.append(g)
        active = still
    wins = sum(g.outcome == "win" for g in finished)
    draws = sum(g.outcome == "draw" for g in finished)
    return (moves - illegal) / moves, wins / games, draws / games
