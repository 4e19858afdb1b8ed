"""A match of several Tic-Tac-Toe games in one episode, with a curriculum that adds games as a run goes on.

The model plays X against the seeded random opponent of `earl_stream_envs.tictactoe` for `games + level` games
(capped at `max_games`) in one conversation: when a game ends, the next observation is the next
game's empty board, so the context carries every earlier game of the match. Each game is scored as
`TicTacToe` scores it (an illegal reply loses that game; the match goes on with the next one).

The reward is paid once, at the end of the match: the fraction of its games won (0..1). Like an
answer at the end of a long reasoning trace, the score exists only for a match that was played to
its end: a match cut off by a context limit (`max_episode_tokens`, the static runs of
`bench/context_growth.py`) ends "truncated" with reward 0. `info` on the terminal step: "outcome"
("finished"), "wins", "draws", "losses", "illegal", "games" and "level".

The curriculum (`earl_stream_envs.curriculum`): `level` grows by one every `grow_every` distinct seeds (prompt
groups) this process has seen; with `grow_every=0` (the default) every match has `games` games. With
the embedded tiny model's tokenizer a game takes ~100 tokens of context, so a run that grows from 1 to
8 games goes from ~100 to ~800 tokens per episode.
"""

from __future__ import annotations

from earl_stream_envs.curriculum import CURRICULUM
from earl_stream_envs.tictactoe import TicTacToe

from earl_stream.env import StepResult
from earl_stream.errors import EnvError

__all__ = ["TicTacToeMatch"]

_MAX_GAMES = 100  # game i of a match plays the opponent of seed * _MAX_GAMES + i


class TicTacToeMatch:
    """`games + level` games of Tic-Tac-Toe in one episode; see the module docstring."""

    system_prompt: str = TicTacToe.system_prompt
    max_turn_tokens: int = TicTacToe.max_turn_tokens
    max_episode_tokens: int | None = None  # no limit unless given

    def __init__(self, games: int = 1, max_games: int = 8, grow_every: int = 0,
                 max_episode_tokens: int | None = None) -> None:
        # int() because `env attach --param k=v` may pass strings
        games, max_games, grow_every = int(games), int(max_games), int(grow_every)
        if not 1 <= games <= max_games <= _MAX_GAMES or grow_every < 0:
            raise EnvError(f"TicTacToeMatch needs 1 <= games ({games}) <= max_games ({max_games}) <= {_MAX_GAMES} "
                           f"and grow_every ({grow_every}) >= 0")
        if max_episode_tokens is not None:
            if int(max_episode_tokens) < 1:
                raise EnvError(f"TicTacToeMatch max_episode_tokens must be >= 1 or None, got {max_episode_tokens!r}")
            self.max_episode_tokens = int(max_episode_tokens)
        self.games, self.max_games, self.grow_every = games, max_games, grow_every
        self._game = TicTacToe()
        self._seed = 0
        self._total = 0
        self._played = 0
        self._level = 0
        self._counts: dict[str, int] = {}
        self._done = True

    def match_games(self, level: int) -> int:
        """Games in a match at curriculum `level`."""
        return min(self.max_games, self.games + level)

    async def reset(self, seed: int) -> str:
        """Start the match of `seed` at the seed's curriculum level; the first observation is game 1's board."""
        self._level = CURRICULUM.level(seed, self.grow_every, ("tictactoe_match", self.games, self.grow_every))
        self._seed, self._total, self._played = seed, self.match_games(self._level), 0
        self._counts = {"win": 0, "draw": 0, "loss": 0, "illegal": 0}
        self._done = False
        return await self._game.reset(seed * _MAX_GAMES)

    async def step(self, action_text: str) -> StepResult:
        """Play the reply in the current game; at a game's end show the next board, at the match's end score it."""
        if self._done:
            raise EnvError("TicTacToeMatch.step() called on a finished match; call reset(seed) first")
        result = await self._game.step(action_text)
        if not result.done:
            return result
        self._counts[result.info["outcome"]] += 1
        self._played += 1
        if self._played < self._total:
            return StepResult(await self._game.reset(self._seed * _MAX_GAMES + self._played), 0.0, False)
        self._done = True
        info = {"outcome": "finished", "wins": self._counts["win"], "draws": self._counts["draw"],
                "losses": self._counts["loss"], "illegal": self._counts["illegal"], "games": self._total,
                "level": self._level}
        return StepResult(result.observation, self._counts["win"] / self._total, True, info)

    def legal_moves(self) -> list[int]:
        """The empty cells of the current game (for the warm start's synthetic play); empty once the match is over."""
        return [] if self._done else self._game.legal_moves()
