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
"""

from __future__ import annotations

import math
import random
import re
import string

from earl_stream_envs.curriculum import CURRICULUM

from earl_stream.env import StepResult
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
                 max_filler_words: int = 20000) -> None:
        # int() because `env attach --param k=v` may pass strings
        turns, max_turns, facts, grow_every = int(turns), int(max_turns), int(facts_per_turn), int(grow_every)
        filler_words, filler_factor, max_filler = int(filler_words), float(filler_factor), int(max_filler_words)
        if filler_words < 0 or filler_factor < 1.0 or max_filler < filler_words:
            raise EnvError(f"LongRecall needs filler_words ({filler_words}) >= 0, filler_factor ({filler_factor}) >= 1 "
                           f"and max_filler_words ({max_filler}) >= filler_words")
        self.filler_words, self.filler_factor, self.max_filler_words = filler_words, filler_factor, max_filler
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

    async def reset(self, seed: int) -> str:
        """Draw the facts and the question of `seed` at the seed's curriculum level; show the first facts."""
        key = (self.turns, self.grow_every) if not self.filler_words else \
            (self.turns, self.grow_every, self.filler_words, self.filler_factor)
        self._level = CURRICULUM.level(seed, self.grow_every, key)
        n = self.episode_turns(self._level)
        rng = random.Random(seed)
        keys = rng.sample(_KEYS, n * self.facts_per_turn)
        values = [rng.randint(1, 9) for _ in keys]
        facts = [f"{k}={v}" for k, v in zip(keys, values)]
        self._pages = [" ".join(facts[i:i + self.facts_per_turn]) for i in range(0, len(facts), self.facts_per_turn)]
        if self.filler_words:
            words = self.page_filler_words(self._level)
            self._pages = [f"{page}\nNotes: " + " ".join(rng.choices(_FILLER, k=words)) + "." for page in self._pages]
        ask = rng.randrange(len(keys))
        self._key, self._value = keys[ask], values[ask]
        self._shown, self._done = 1, False
        return f"Facts: {self._pages[0]}"

    async def step(self, action_text: str) -> StepResult:
        """Show the next facts, or the question after the last of them, or score the answer."""
        if self._done:
            raise EnvError("LongRecall.step() called on a finished episode; call reset(seed) first")
        if self._shown < len(self._pages):
            self._shown += 1
            return StepResult(f"Facts: {self._pages[self._shown - 1]}", 0.0, False)
        if self._shown == len(self._pages):
            self._shown += 1
            return StepResult(f"What is {self._key}?", 0.0, False)
        self._done = True
        match = _DIGIT.search(action_text)
        outcome = "no_answer" if match is None else "correct" if int(match.group()) == self._value else "wrong"
        info = {"outcome": outcome, "expected": self._value, "turns": len(self._pages), "level": self._level}
        return StepResult("", 1.0 if outcome == "correct" else 0.0, True, info)
