"""TextArena's two-player text games (https://pypi.org/project/textarena/) against a scripted opponent.

`TextArenaEnv(game="TicTacToe-v0")` builds the game with `textarena.make` and plays the model as
player `model_player` (0 moves first; "random" draws the side from the seed) against an opponent
policy, wrapping TextArena's `reset(num_players, seed)`, `get_observation()`, `step(action)` and
`close()` in earl_stream's protocol. The observation is what TextArena shows the model's player since
its previous turn (the game's prompt first, then the opponent's moves, the board, admin messages),
one "[GAME] ..." / "[Player 1] ..." line per message, as TextArena's own LLM wrapper renders them, minus
the echo of the model's own move. Actions follow the game's syntax (e.g. "[4]"); a reply without
brackets is wrapped in them, as TextArena's default ActionFormattingWrapper does.

Opponents: "random" picks uniformly among the moves the game lists to the opponent (quoted or bare
bracketed moves such as '[4]' in "Available Moves", "Valid moves", "available actions"), or among the
legal moves of a built-in table for games that list none (ConnectFour, Nim); "first" picks the first
such move; "module:function" or a callable `(observation: str, rng: random.Random) -> str` is a
scripted policy. The opponent's randomness is `random.Random(seed)`.

Reward: TextArena's final reward for the model's player (+1 win, -1 loss, 0 draw in two-player games).
`info["outcome"]` is "win", "loss", "draw", "illegal" (the game ended on the model's invalid moves;
TextArena allows one retry by default), or "truncated" after `max_turns` model turns (reward 0).

TextArena seeds and uses the global `random` module. Every call into it runs with this episode's own
saved global RNG state swapped in (and the caller's restored after), so concurrent episodes in one
process neither disturb each other nor anyone else's use of `random`, and a seed replays exactly.

Not every game runs here: on Python 3.11 some modules (Chess, Checkers, ReverseTicTacToe) fail to
import (they use 3.12 f-string syntax), and word games need NLTK corpora that are downloaded on first
use, which fails offline. Both raise EnvError at construction.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from earl_stream.env import StepResult
from earl_stream.errors import EnvError

__all__ = ["TextArenaEnv", "first_opponent", "listed_moves", "random_opponent"]

Opponent = Callable[[str, random.Random], str]

_QUOTED = re.compile(r"'(\[[^\[\]'\n]{1,40}\])'")
_BARE = re.compile(r"\[[^\[\]\n]{1,40}\]")
_ROLE_TAG = re.compile(r"\[(GAME|Player \d+)\]")
_MAX_OPPONENT_STEPS = 1000


def _ta() -> Any:
    try:
        import textarena
    except ImportError as exc:
        raise EnvError("TextArenaEnv needs the textarena package: pip install textarena") from exc
    return textarena


def listed_moves(observation: str) -> list[str]:
    """The moves a TextArena observation offers, e.g. ["[0]", "[4]"], from its last message listing any.

    Quoted moves ('[4]') are preferred; otherwise bare bracketed tokens except role tags ([GAME]).
    """
    for block in reversed(observation.split("\n[")):
        quoted = _QUOTED.findall(block)
        if quoted:
            return list(dict.fromkeys(quoted))
    for line in reversed(observation.splitlines()):
        bare = [m for m in _BARE.findall(line) if not _ROLE_TAG.fullmatch(m)]
        if len(bare) > 1:
            return list(dict.fromkeys(bare))
    return []


def random_opponent(observation: str, rng: random.Random) -> str:
    """A uniformly random listed move (see `listed_moves`); "[0]" if none is listed."""
    moves = listed_moves(observation)
    return rng.choice(moves) if moves else "[0]"


def first_opponent(observation: str, rng: random.Random) -> str:
    """The first listed move; "[0]" if none is listed."""
    moves = listed_moves(observation)
    return moves[0] if moves else "[0]"


def _connect_four_moves(game_state: dict[str, Any]) -> list[str]:
    top = game_state["board"][0]
    return [f"[col {c}]" for c, cell in enumerate(top) if cell == "."]


def _nim_moves(game_state: dict[str, Any]) -> list[str]:
    return [f"[{i} {q}]" for i, pile in enumerate(game_state["piles"]) for q in range(1, pile + 1)]


# Games whose observations do not list the legal moves: the random opponent reads its state instead.
_LEGAL_MOVES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "ConnectFour": _connect_four_moves,
    "Nim": _nim_moves,
}


def _resolve_opponent(opponent: str | Opponent) -> tuple[str, Opponent]:
    if callable(opponent):
        return getattr(opponent, "__name__", "callable"), opponent
    if opponent == "random":
        return "random", random_opponent
    if opponent == "first":
        return "first", first_opponent
    module_name, _, attr = opponent.partition(":")
    if not module_name or not attr:
        raise EnvError(f"opponent must be 'random', 'first', 'module:function' or a callable, got {opponent!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise EnvError(f"opponent {opponent!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise EnvError(f"opponent {opponent!r} is not callable")
    return opponent, fn


class TextArenaEnv:
    """A TextArena two-player game: the model is one player, a scripted opponent the other."""

    def __init__(self, game: str = "TicTacToe-v0", model_player: int | str = 0,
                 opponent: str | Opponent = "random", max_turns: int = 100,
                 system_prompt: str | None = None, max_turn_tokens: int = 32,
                 env_kwargs: dict[str, Any] | None = None) -> None:
        ta = _ta()
        if game not in ta.envs.registration.ENV_REGISTRY:
            raise EnvError(f"unknown TextArena game {game!r}; see textarena.envs.registration.ENV_REGISTRY")
        if model_player not in (0, 1, "0", "1", "random"):
            raise EnvError(f"model_player must be 0, 1 or 'random', got {model_player!r}")
        self.game = game
        self.model_player = model_player if model_player == "random" else int(model_player)
        self.opponent_name, self._opponent = _resolve_opponent(opponent)
        self.max_turns, self.max_turn_tokens = int(max_turns), int(max_turn_tokens)
        self.system_prompt: str | None = system_prompt
        self._env_kwargs = dict(env_kwargs or {})
        self._env = self._make()  # fail at construction (attach time) if the game cannot run here
        self._legal = _LEGAL_MOVES.get(type(self._env).__name__.removesuffix("Env"))
        self._rng = random.Random(0)
        self._ta_random: Any = random.Random(0).getstate()
        self._me, self._turns, self._done = 0, 0, True

    def _make(self) -> Any:
        ta = _ta()
        outer = random.getstate()
        try:
            env = ta.make(self.game, **self._env_kwargs)
            env.reset(num_players=2, seed=0)  # a trial game: word games load their corpora here
        except Exception as exc:  # third-party import/setup failure: report which game and why
            raise EnvError(f"TextArena game {self.game!r} cannot run here: {type(exc).__name__}: {exc}") from exc
        finally:
            random.setstate(outer)
        while isinstance(env, ta.Wrapper):  # we render observations and format actions ourselves
            env = env.env
        return env

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        outer = random.getstate()
        random.setstate(self._ta_random)
        try:
            yield
        finally:
            self._ta_random = random.getstate()
            random.setstate(outer)

    async def reset(self, seed: int) -> str:
        """Start a game seeded with `seed`; play the opponent's opening moves if it moves first."""
        self._rng = random.Random(seed)
        self._me = self._rng.randrange(2) if self.model_player == "random" else int(self.model_player)
        self._turns, self._done = 0, False
        outer = random.getstate()
        try:
            self._env.reset(num_players=2, seed=seed)  # seeds the global random: capture it as ours
            self._ta_random = random.getstate()
        finally:
            random.setstate(outer)
        with self._own_random():
            if self._play_opponent():
                raise EnvError(f"TextArena game {self.game!r} ended before the model's first move")
            return self._observe()

    async def step(self, action_text: str) -> StepResult:
        """Play the model's move, then the opponent's until it is the model's turn or the game ends."""
        if self._done:
            raise EnvError("TextArenaEnv.step() called on a finished game; call reset(seed) first")
        self._turns += 1
        action = action_text.strip()
        if "[" not in action and "]" not in action:
            action = f"[{action}]"
        with self._own_random():
            done, _ = self._env.step(action)
            if not done:
                done = self._play_opponent()
            observation = self._observe()
            if done:
                return self._finish(observation)
        if self._turns >= self.max_turns:
            self._done = True
            return StepResult(observation, 0.0, True, {"outcome": "truncated", "game": self.game})
        return StepResult(observation, 0.0, False)

    def _play_opponent(self) -> bool:
        """Let the opponent move while it is its turn; True if the game ended."""
        for _ in range(_MAX_OPPONENT_STEPS):
            player = self._env.state.current_player_id
            if player == self._me:
                return False
            done, _ = self._env.step(self._opponent_move(self._render(self._drain(player), player)))
            if done:
                return True
        raise EnvError(f"TextArena game {self.game!r}: the opponent did not hand the turn back")

    def _opponent_move(self, observation: str) -> str:
        if self._legal is None or self.opponent_name not in ("random", "first"):
            return str(self._opponent(observation, self._rng))
        moves = self._legal(self._env.state.game_state) or ["[0]"]
        return self._rng.choice(moves) if self.opponent_name == "random" else moves[0]

    def _drain(self, player: int) -> list[tuple[int, str, Any]]:
        # Not env.get_observation(): that reads the player to move, and after the last move of a
        # game that may be the opponent rather than the model.
        messages: list[tuple[int, str, Any]] = self._env.state.observations[player]
        self._env.state.observations[player] = []
        return messages

    def _observe(self) -> str:
        return self._render(self._drain(self._me), self._me)

    def _render(self, messages: list[tuple[int, str, Any]], player: int) -> str:
        ta = _ta()
        lines = []
        for sender, message, kind in messages:
            if sender == player and kind == ta.ObservationType.PLAYER_ACTION:
                continue  # the model's own move, already in its context
            name = "GAME" if sender == ta.GAME_ID else self._env.state.role_mapping.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {message}")
        return "\n".join(lines)

    def _finish(self, observation: str) -> StepResult:
        self._done = True
        rewards, game_info = self._env.close()
        reward = float((rewards or {}).get(self._me, 0.0))
        mine = (game_info or {}).get(self._me, {})
        if mine.get("invalid_move"):
            outcome = "illegal"
        else:
            outcome = "win" if reward > 0 else ("loss" if reward < 0 else "draw")
        info = {"outcome": outcome, "game": self.game, "reason": str(mine.get("reason", ""))[:200]}
        return StepResult(observation, reward, True, info)
