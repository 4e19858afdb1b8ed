"""Connect Four (7 columns x 6 rows) against a seeded, uniformly random opponent.

EARL's evaluation game. The model plays X and moves first; O drops its disc into a column drawn
uniformly among the non-full ones with `random.Random(seed)` from `reset(seed)`, so an episode is a
pure function of the seed and the model's replies. The observation is the board alone: a header line
with the column numbers, then the six rows from top to bottom, cells separated by one space, "." for
an empty cell, e.g.

    1 2 3 4 5 6 7
    . . . . . . .
    . . . . . . .
    . . . . . . .
    . . . . . . .
    . . . O . . .
    . . X X . . .

The action is the number (1..7) of a non-full column, alone after stripping whitespace. Rewards (only
the terminal step is non-zero): win +1.0, draw 0.0 (full board), loss -1.0; an illegal or unparseable
reply ends the game with -1.0. `info["outcome"]` is one of "win", "draw", "loss", "illegal", on the
terminal step only.
"""

from __future__ import annotations

import random

from earl_stream.env import StepResult
from earl_stream.errors import EnvError

__all__ = ["COLUMNS", "ROWS", "ConnectFour"]

COLUMNS = 7
ROWS = 6
_MOVES = frozenset(str(c) for c in range(1, COLUMNS + 1))
_DIRECTIONS: tuple[tuple[int, int], ...] = ((0, 1), (1, 0), (1, 1), (1, -1))
_HEADER = " ".join(str(c) for c in range(1, COLUMNS + 1))


class ConnectFour:
    """One game of Connect Four per `reset`; the model is X and starts, a seeded random player is O."""

    system_prompt: str = (
        "Play Connect Four as X on a 7-column, 6-row board; connect four in a row to win. "
        "Reply with the number (1-7) of a column that is not full."
    )
    max_turn_tokens: int = 4
    # The seed draws only the opponent's moves, not the task: a group's games each get their own opponent
    # (`EnvSpec.group_seed: auto`), else a near-deterministic policy plays its group's games alike and a
    # mistake it always makes is never contrasted with a win.
    seed_per_episode: bool = True

    def __init__(self) -> None:
        # _grid[row][col], row 0 is the bottom row; "" is empty.
        self._grid: list[list[str]] = [[""] * COLUMNS for _ in range(ROWS)]
        self._heights = [0] * COLUMNS
        self._rng = random.Random(0)
        self._done = True

    async def reset(self, seed: int) -> str:
        """Start a new game whose opponent draws its columns from `random.Random(seed)`."""
        self._grid = [[""] * COLUMNS for _ in range(ROWS)]
        self._heights = [0] * COLUMNS
        self._rng = random.Random(seed)
        self._done = False
        return self.render()

    async def step(self, action_text: str) -> StepResult:
        """Drop X into the column named by `action_text`, then O's reply unless the game is over."""
        if self._done:
            raise EnvError("ConnectFour.step() called on a finished game; call reset(seed) first")
        move = action_text.strip()
        if move not in _MOVES or self._heights[int(move) - 1] >= ROWS:
            return self._finish(-1.0, "illegal")
        if self._drop(int(move) - 1, "X"):
            return self._finish(1.0, "win")
        if self._full():
            return self._finish(0.0, "draw")
        if self._drop(self._rng.choice(self.legal_moves()) - 1, "O"):
            return self._finish(-1.0, "loss")
        if self._full():
            return self._finish(0.0, "draw")
        return StepResult(self.render(), 0.0, False)

    def legal_moves(self) -> list[int]:
        """The numbers (1..7) of the non-full columns, ascending; empty once the game is over."""
        if self._done:
            return []
        return [c + 1 for c in range(COLUMNS) if self._heights[c] < ROWS]

    def render(self) -> str:
        """The board as the model sees it: the column header, then rows from top to bottom."""
        rows = [" ".join(cell or "." for cell in self._grid[r]) for r in range(ROWS - 1, -1, -1)]
        return "\n".join([_HEADER, *rows])

    def _drop(self, col: int, mark: str) -> bool:
        """Place `mark` in `col` (0-based, not full); True if that move connects four."""
        row = self._heights[col]
        self._grid[row][col] = mark
        self._heights[col] += 1
        return any(self._run(row, col, dr, dc, mark) >= 4 for dr, dc in _DIRECTIONS)

    def _run(self, row: int, col: int, dr: int, dc: int, mark: str) -> int:
        """Length of the line of `mark` through (row, col) along (dr, dc), both ways."""
        count = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < ROWS and 0 <= c < COLUMNS and self._grid[r][c] == mark:
                count += 1
                r, c = r + sign * dr, c + sign * dc
        return count

    def _full(self) -> bool:
        return all(h >= ROWS for h in self._heights)

    def _finish(self, reward: float, outcome: str) -> StepResult:
        self._done = True
        return StepResult(self.render(), reward, True, {"outcome": outcome})
