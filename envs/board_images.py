"""Tic-Tac-Toe and Connect Four shown as pictures: the same games, rules and rewards as `tictactoe` and
`connect_four`, but each observation is an image of the board (no text board) and the line "Your move.".

`tictactoe_image`: a 96 x 96 picture, a 3 x 3 grid of 32-pixel cells; X is a dark cross, O a blue ring, an empty
cell is white. The cells are numbered 1-9 row by row from the top left (the system prompt says so), and the reply
is the number of an empty cell, as in the text game.

`connect_four_image`: a 168 x 144 picture, 7 columns x 6 rows of 24-pixel cells on a blue board; X is a red disc,
O a yellow one, an empty hole white. The reply is the number (1-7, left to right) of a column that is not full.

The pictures are drawn with lines and ellipses only (no font), so the same board gives the same PNG bytes on any
machine with the same Pillow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from earl_stream_envs.connect_four import COLUMNS, ROWS, ConnectFour
from earl_stream_envs.tictactoe import TicTacToe

from earl_stream.env import Observation, StepResult

__all__ = ["ConnectFourImage", "TicTacToeImage", "connect_four_picture", "tictactoe_picture"]

PROMPT = "Your move."
_TTT_CELL = 32
_C4_CELL = 24


def _canvas(width: int, height: int, background: tuple[int, int, int]) -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), background)
    return img, ImageDraw.Draw(img)


def tictactoe_picture(cells: Sequence[str]) -> Any:
    """The 9 cells ("X", "O" or "", row-major) as a 96 x 96 PIL image."""
    c = _TTT_CELL
    img, draw = _canvas(3 * c, 3 * c, (255, 255, 255))
    for k in (1, 2):
        draw.line([(k * c, 0), (k * c, 3 * c - 1)], fill=(0, 0, 0), width=2)
        draw.line([(0, k * c), (3 * c - 1, k * c)], fill=(0, 0, 0), width=2)
    for i, mark in enumerate(cells):
        x, y, pad = (i % 3) * c, (i // 3) * c, 7
        if mark == "X":
            draw.line([(x + pad, y + pad), (x + c - pad, y + c - pad)], fill=(20, 20, 20), width=4)
            draw.line([(x + pad, y + c - pad), (x + c - pad, y + pad)], fill=(20, 20, 20), width=4)
        elif mark == "O":
            draw.ellipse([(x + pad, y + pad), (x + c - pad, y + c - pad)], outline=(30, 80, 220), width=4)
    return img


def connect_four_picture(grid: Sequence[Sequence[str]]) -> Any:
    """A Connect Four grid (`grid[row][col]`, row 0 at the bottom; "X", "O" or "") as a 168 x 144 PIL image."""
    c = _C4_CELL
    img, draw = _canvas(COLUMNS * c, ROWS * c, (30, 60, 170))
    colours = {"X": (220, 30, 30), "O": (240, 210, 40), "": (255, 255, 255)}
    for row in range(ROWS):
        for col in range(COLUMNS):
            x, y = col * c, (ROWS - 1 - row) * c  # row 0 drawn at the bottom
            draw.ellipse([(x + 3, y + 3), (x + c - 3, y + c - 3)], fill=colours[grid[row][col]])
    return img


class _Pictured:
    """The text game's reset and step, each observation replaced by `observe()`'s picture (mixed in before it)."""

    async def reset(self, seed: int) -> Observation:  # the picture, where the text game returns its board
        await super().reset(seed)  # type: ignore[misc]
        return self.observe()

    async def step(self, action_text: str) -> StepResult:
        result: StepResult = await super().step(action_text)  # type: ignore[misc]
        return StepResult(self.observe(), result.reward, result.done, result.info)

    def observe(self) -> Observation:
        raise NotImplementedError


class TicTacToeImage(_Pictured, TicTacToe):
    """Tic-Tac-Toe whose observations are pictures of the board (`tictactoe_picture`)."""

    system_prompt: str = ("Play Tic-Tac-Toe as X on the board in the picture; its cells are numbered 1-9 row by "
                          "row from the top left. Reply with the number of an empty cell.")

    def observe(self) -> Observation:
        return Observation(PROMPT, [tictactoe_picture(self._board or [""] * 9)])


class ConnectFourImage(_Pictured, ConnectFour):
    """Connect Four whose observations are pictures of the board (`connect_four_picture`)."""

    system_prompt: str = ("Play Connect Four as X (red) on the board in the picture, 7 columns numbered 1-7 from "
                          "the left, 6 rows; connect four in a row to win. Reply with the number of a column that "
                          "is not full.")

    def observe(self) -> Observation:
        return Observation(PROMPT, [connect_four_picture(self._grid)])
