"""Tic-Tac-Toe against a seeded, uniformly random opponent.

The model plays X and moves first; O picks uniformly among the empty cells with
`random.Random(seed)` from `reset(seed)`, so an episode is a pure function of the seed and the
model's replies. The observation is the board alone: three lines, cells separated by one space,
empty cells shown as their number 1..9 (row-major), e.g. "X O 3\\n4 X 6\\n7 8 O".

Rewards (only the terminal step is non-zero): win +1.0, draw 0.0, loss -1.0, and an illegal reply
(anything but the digit of an empty cell, after stripping whitespace) ends the game with -1.0.
`info["outcome"]` is one of "win", "draw", "loss", "illegal", on the terminal step only.
"""

from __future__ import annotations

import random

from earl_stream.env import StepResult
from earl_stream.errors import EnvError

__all__ = ["TicTacToe", "render_board", "winner"]

_LINES: tuple[tuple[int, int, int], ...] = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),
    (0, 3, 6), (1, 4, 7), (2, 5, 8),
    (0, 4, 8), (2, 4, 6),
)
_MOVES = frozenset("123456789")


def render_board(cells: list[str] | tuple[str, ...]) -> str:
    """9 cells ("X", "O" or "" for empty, row-major) as the model sees them, e.g. "X O 3\\n4 X 6\\n7 8 O"."""
    shown = [cell or str(i + 1) for i, cell in enumerate(cells)]
    return "\n".join(" ".join(shown[r * 3:r * 3 + 3]) for r in range(3))


def winner(cells: list[str] | tuple[str, ...]) -> str:
    """The mark ("X" or "O") that holds a line of the 9 cells; "" when none does."""
    return next((cells[a] for a, b, c in _LINES if cells[a] and cells[a] == cells[b] == cells[c]), "")


class TicTacToe:
    """One game of Tic-Tac-Toe per `reset`; the model is X, a seeded random player is O."""

    system_prompt: str = "Play Tic-Tac-Toe as X. Reply with the number of an empty cell."
    max_turn_tokens: int = 4
    # The seed draws only the opponent's moves, not the task: a group's games each get their own opponent
    # (`EnvSpec.group_seed: auto`), else a near-deterministic policy plays its group's games alike and a
    # mistake it always makes is never contrasted with a win.
    seed_per_episode: bool = True

    def __init__(self) -> None:
        self._board: list[str] = []
        self._rng = random.Random(0)
        self._done = True

    async def reset(self, seed: int) -> str:
        """Start a new game whose opponent draws its moves from `random.Random(seed)`."""
        self._board = [""] * 9
        self._rng = random.Random(seed)
        self._done = False
        return self.render()

    async def step(self, action_text: str) -> StepResult:
        """Play X at the cell named by `action_text`, then O's reply unless the game is over."""
        if self._done:
            raise EnvError("TicTacToe.step() called on a finished game; call reset(seed) first")
        move = action_text.strip()
        if move not in _MOVES or self._board[int(move) - 1]:
            return self._finish(-1.0, "illegal")
        self._board[int(move) - 1] = "X"
        if self._winner() == "X":
            return self._finish(1.0, "win")
        if all(self._board):
            return self._finish(0.0, "draw")
        self._board[self._rng.choice(self.legal_moves()) - 1] = "O"
        if self._winner() == "O":
            return self._finish(-1.0, "loss")
        if all(self._board):
            return self._finish(0.0, "draw")
        return StepResult(self.render(), 0.0, False)

    def legal_moves(self) -> list[int]:
        """The numbers (1..9) of the empty cells, ascending; empty once the game is over."""
        if self._done:
            return []
        return [i + 1 for i, cell in enumerate(self._board) if not cell]

    def render(self) -> str:
        """The board as the model sees it, e.g. "X O 3\\n4 X 6\\n7 8 O"."""
        return render_board(self._board or [""] * 9)

    def _winner(self) -> str:
        return winner(self._board)

    def _finish(self, reward: float, outcome: str) -> StepResult:
        self._done = True
        return StepResult(self.render(), reward, True, {"outcome": outcome})
