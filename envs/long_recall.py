"""Key-value recall over many turns, with a curriculum that makes the episodes longer as a run goes on.

Each episode shows the model `facts_per_turn` facts per turn ("Q7=3 B2=8 ..."; keys are a capital
letter and a digit, values a digit 1-9) for a number of turns, then asks for the value of one key
shown earlier. Fact turns take any reply (the model may acknowledge); only the final answer is
scored: reward 1.0 when the first digit of the reply is the value, 0.0 otherwise (a uniformly
guessing policy scores 1/9). `info["outcome"]` on the terminal step is "correct", "wrong" or
"no_answer", with "expected", "turns" and "level".

The curriculum: the number of fact turns is `turns + level` (capped at `max_turns`), where `level`
grows by one every `grow_every` distinct seeds (prompt groups) this process has seen. A seed's level
is fixed the first time the process sees it, so every member of a GRPO group (same seed) gets the
same episode and a seed replays exactly within a process; across processes an episode depends on
how many seeds that process saw before (with `grow_every=0`, the default, it is a pure function of
the seed). Each fact turn adds ~35 tokens of context with the embedded tiny model's tokenizer,
so a run that starts at 2 turns (~100 tokens) and grows to 24 reaches ~900 tokens per episode.

Filler (a haystack around the facts, for long contexts at few turns): with `filler_words` > 0 each fact
page also carries "Notes:" and round(filler_words x filler_factor ** level) words (at most
`max_filler_words`) drawn from a fixed list of common English words by the seed, so a page's length
grows geometrically with the level while the number of turns (and of model replies) stays small. With
SmolLM2-135M's tokenizer a filler word is ~1.0 token: `turns=1, max_turns=1, facts_per_turn=2,
filler_words=440, filler_factor=2.1` gives ~500 tokens per episode at level 0 and ~4,200 at level 3
(bench/real_scale.py, tests/envs/test_long_recall.py).

Facts near the question (`facts_last=True`, needs filler): a page is the filler document first, then its
facts ("Notes: <filler>.\nFacts: Q7=3 B2=8"), so the facts sit next to the question however long the
document grows, and the question comes with the last page ("What is the value of B2? Reply with the digit
only."), answered in one reply of up to 8 tokens (a key's own digit in the reply is not an answer): a model
that reads the end of its context can answer at every length (SmolLM2-135M-Instruct earns reward at every
level this way; with the facts first and 3-token replies it never answers with a value).

A schedule of levels (`level_groups`, e.g. "8,8,6,6"): the number of prompt groups (distinct seeds) at
each level, in order; past their sum the last level stays. It replaces `grow_every` (a fixed number of
groups per level) where a run should spend most of its steps at short and middle lengths and a tail at the
longest. `held_out` gives evaluation items at every level of the schedule (seed i of the set at level
i mod levels), from the evaluation seeds no run issues for training, without touching the curriculum.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import string
from typing import Any

from earl_stream_envs.curriculum import CURRICULUM

from earl_stream.env import StepResult
from earl_stream.env.seeds import eval_seeds
from earl_stream.errors import EnvError

__all__ = ["LongRecall"]

_KEYS = [f"{c}{d}" for c in string.ascii_uppercase for d in range(10)]
_DIGIT = re.compile(r"[1-9]")
# common short words, each a single token (after a space) for the usual BPE vocabularies
_FILLER = ("the", "river", "stone", "light", "green", "house", "under", "over", "small", "large", "water", "field",
           "cloud", "north", "south", "early", "late", "bread", "table", "chair", "paper", "music", "horse", "garden",
           "window", "street", "market", "winter", "summer", "morning", "evening", "road", "tree", "bird", "blue",
           "red", "old", "new", "long", "short", "warm", "cold", "quiet", "open", "door", "wall", "hill", "lake",
           "city", "town", "book", "letter", "story", "song", "friend", "family", "school", "work", "day", "night",
           "year", "time", "place", "world")


class LongRecall:
    """Remember the facts of every turn; answer one question at the end. See the module docstring."""

    max_turn_tokens: int = 3
    max_episode_tokens: int | None = None  # no limit unless given (the static-limit runs of bench/context_growth.py)
    system_prompt: str = "Remember every fact. At the end, reply with the value of the key asked for."

    def __init__(self, turns: int = 2, max_turns: int = 24, facts_per_turn: int = 4, grow_every: int = 0,
                 max_episode_tokens: int | None = None, filler_words: int = 0, filler_factor: float = 1.0,
                 max_filler_words: int = 20000, facts_last: bool = False, level_groups: str | list[int] = "",
                 fixed_levels: int = 0) -> None:
        # int() because `env attach --param k=v` may pass strings
        turns, max_turns, facts, grow_every = int(turns), int(max_turns), int(facts_per_turn), int(grow_every)
        filler_words, filler_factor, max_filler = int(filler_words), float(filler_factor), int(max_filler_words)
        if filler_words < 0 or filler_factor < 1.0 or max_filler < filler_words:
            raise EnvError(f"LongRecall needs filler_words ({filler_words}) >= 0, filler_factor ({filler_factor}) >= 1 "
                           f"and max_filler_words ({max_filler}) >= filler_words")
        self.filler_words, self.filler_factor, self.max_filler_words = filler_words, filler_factor, max_filler
        self.facts_last = facts_last if isinstance(facts_last, bool) else str(facts_last).lower() in ("1", "true")
        self.level_groups = _parse_groups(level_groups)
        self.fixed_levels = int(fixed_levels)
        if self.facts_last:  # room for "The value of B2 is 8"
            self.max_turn_tokens = 8
        if self.fixed_levels < 0 or (self.facts_last and not filler_words):
            raise EnvError(f"LongRecall needs fixed_levels ({self.fixed_levels}) >= 0 and filler_words > 0 with "
                           "facts_last")
        if max_episode_tokens is not None:  # a hard context limit: longer episodes end "truncated", reward 0
            if int(max_episode_tokens) < 1:
                raise EnvError(f"LongRecall max_episode_tokens must be >= 1 or None, got {max_episode_tokens!r}")
            self.max_episode_tokens = int(max_episode_tokens)
        if not 1 <= turns <= max_turns or not 1 <= facts or max_turns * facts > len(_KEYS) or grow_every < 0:
            raise EnvError(f"LongRecall needs 1 <= turns ({turns}) <= max_turns ({max_turns}), facts_per_turn "
                           f"({facts}) >= 1, max_turns x facts_per_turn <= {len(_KEYS)} distinct keys and "
                           f"grow_every ({grow_every}) >= 0")
        self.turns, self.max_turns, self.facts_per_turn, self.grow_every = turns, max_turns, facts, grow_every
        self._pages: list[str] = []
        self._key, self._value = "", 0
        self._shown = 0
        self._level = 0
        self._done = True

    def episode_turns(self, level: int) -> int:
        """Fact turns of an episode at curriculum `level`."""
        return min(self.max_turns, self.turns + level)

    def page_filler_words(self, level: int) -> int:
        """Filler words on each fact page of an episode at curriculum `level` (at most `max_filler_words`,
        however high the level: past a few hundred levels the growth would overflow a float)."""
        if self.filler_words == 0 or self.filler_factor == 1.0:
            return min(self.max_filler_words, self.filler_words)
        if level >= math.log(self.max_filler_words / self.filler_words, self.filler_factor):
            return self.max_filler_words
        return min(self.max_filler_words, round(self.filler_words * self.filler_factor ** level))

    @classmethod
    def held_out(cls, params: dict[str, Any], problems: int) -> tuple[dict[str, Any], list[int]]:
        """Params and seeds of `problems` evaluation items (`earl_stream.evaluation.heldout`): the evaluation
        seeds (never issued for training), item i at level i mod the schedule's levels (its `level_groups`,
        else one level: 0), with the curriculum left alone."""
        levels = len(_parse_groups(params.get("level_groups", ""))) or 1
        return {**params, "level_groups": "", "grow_every": 0, "fixed_levels": levels}, eval_seeds(problems)

    def _level_of(self, seed: int) -> int:
        if self.fixed_levels:
            return (seed - eval_seeds(1)[0]) % self.fixed_levels
        key = (self.turns, self.grow_every) if not self.filler_words else \
            (self.turns, self.grow_every, self.filler_words, self.filler_factor)
        if not self.level_groups:
            return CURRICULUM.level(seed, self.grow_every, key)
        ordinal = CURRICULUM.level(seed, 1, (*key, tuple(self.level_groups)))  # distinct seeds seen before
        ends = list(itertools.accumulate(self.level_groups))
        return next((k for k, end in enumerate(ends) if ordinal < end), len(ends) - 1)

    async def reset(self, seed: int) -> str:
        """Draw the facts and the question of `seed` at the seed's curriculum level; show the first facts."""
        self._level = self._level_of(seed)
        n = self.episode_turns(self._level)
        rng = random.Random(seed)
        keys = rng.sample(_KEYS, n * self.facts_per_turn)
        values = [rng.randint(1, 9) for _ in keys]
        facts = [f"{k}={v}" for k, v in zip(keys, values)]
        self._pages = [" ".join(facts[i:i + self.facts_per_turn]) for i in range(0, len(facts), self.facts_per_turn)]
        if self.filler_words:
            words = self.page_filler_words(self._level)
            notes = [" ".join(rng.choices(_FILLER, k=words)) for _ in self._pages]
            self._pages = [f"Notes: {n}.\nFacts: {page}" if self.facts_last else f"{page}\nNotes: {n}."
                           for page, n in zip(self._pages, notes)]
        ask = rng.randrange(len(keys))
        self._key, self._value = keys[ask], values[ask]
        self._shown, self._done = 1, False
        return self._show(0)

    def _show(self, i: int) -> str:
        if not self.facts_last:
            return f"Facts: {self._pages[i]}"
        last = i == len(self._pages) - 1  # the question comes with the last page: it is answered in one reply
        return self._pages[i] + (f"\nWhat is the value of {self._key}? Reply with the digit only." if last else "")

    async def step(self, action_text: str) -> StepResult:
        """Show the next facts, or the question after the last of them, or score the answer."""
        if self._done:
            raise EnvError("LongRecall.step() called on a finished episode; call reset(seed) first")
        if self._shown < len(self._pages):
            self._shown += 1
            return StepResult(self._show(self._shown - 1), 0.0, False)
        if self._shown == len(self._pages) and not self.facts_last:
            self._shown += 1
            return StepResult(f"What is {self._key}?", 0.0, False)
        self._done = True
        match = _DIGIT.search(action_text.replace(self._key, ""))  # "B2 is 8": the key's own digit is no answer
        outcome = "no_answer" if match is None else "correct" if int(match.group()) == self._value else "wrong"
        info = {"outcome": outcome, "expected": self._value, "turns": len(self._pages), "level": self._level}
        return StepResult("", 1.0 if outcome == "correct" else 0.0, True, info)


def _parse_groups(value: str | list[int] | tuple[int, ...]) -> list[int]:
    """ "8,8,6,6" (or "8|8|6|6", or a list) -> [8, 8, 6, 6]; "" -> []."""
    if isinstance(value, (list, tuple)):
        groups = [int(v) for v in value]
    else:
        groups = [int(v) for v in re.split(r"[,|]", str(value)) if v.strip()]
    if any(g < 1 for g in groups):
        raise EnvError(f"LongRecall level_groups needs counts >= 1, got {value!r}")
    return groups
