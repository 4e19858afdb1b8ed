"""A tiny environment with held-out items, for the evaluation tests: item `seed` asks for a reply whose length
has the parity of `seed`; a random tiny model gets about half right, so success and pass@k are not trivial.

Training poses items `seed % size`; `held_out` gives items from `size` on (never posed in training), and its
prompts say "held-out" so that a test can tell an evaluation episode from a training one by its tokens.
"""

from __future__ import annotations

from typing import Any

from earl_stream.env import StepResult


class ParityEnv:
    max_turn_tokens = 6

    def __init__(self, size: int = 1000, held: bool = False) -> None:
        self.size, self.held = int(size), bool(held)
        self.item = 0

    @classmethod
    def held_out(cls, params: dict[str, Any], problems: int) -> tuple[dict[str, Any], list[int]]:
        size = int(params.get("size", 1000))
        return {**params, "held": True, "size": size + problems}, list(range(size, size + problems))

    async def reset(self, seed: int) -> str:
        self.item = seed if self.held else seed % self.size
        return f"{'held-out ' if self.held else ''}item {self.item}: reply with a text of {'even' if self.item % 2 == 0 else 'odd'} length"

    async def step(self, action_text: str) -> StepResult:
        ok = len(action_text) % 2 == self.item % 2
        outcome = "correct" if ok else "wrong"
        return StepResult(outcome, 1.0 if ok else 0.0, True, {"outcome": outcome})


class NoHeldOut:
    """An environment without held-out items (evaluated on evaluation seeds, earl_stream/env/seeds.py)."""

    async def reset(self, seed: int) -> str:
        return "x"

    async def step(self, action_text: str) -> StepResult:
        return StepResult("", 0.0, True, {"outcome": "wrong"})
