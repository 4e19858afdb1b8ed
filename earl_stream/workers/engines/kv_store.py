"""Prompt KV caches kept between the turns of an episode, so the next turn pre-fills only its new tokens.

Owns `KeptKV` (the KV of one episode's token prefix) and `KVStore` (kept caches by episode key,
least recently used first, bounded in tokens, thread-safe). Which rows reuse what, and batching, is
`torch_engine`'s job.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class KeptKV:
    """KV of one episode's prefix: per layer (keys, values), each [1, kv_heads, len(tokens), head_dim]."""

    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    def prefix(self, n: int) -> KeptKV:
        return KeptKV(self.tokens[:n], [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class KVStore:
    """Kept caches by episode key, least recently used first; thread-safe, bounded in tokens."""

    def __init__(self, budget_tokens: int) -> None:
        self._entries: OrderedDict[str, KeptKV] = OrderedDict()
        self._tokens = 0
        self._budget = budget_tokens
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    def take(self, key: str, prompt: list[int]) -> KeptKV | None:
        """Remove the entry and return its part that is a prefix of `prompt` (None if unusable)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self._tokens -= len(entry.tokens)
        # At least one prompt token must run through the model to produce next-token logits.
        n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
        if n <= 0:
            return None
        return entry if n == len(entry.tokens) else entry.prefix(n)

    def reusable(self, key: str, prompt: list[int]) -> int:
        """How many of `prompt`'s tokens `take(key, prompt)` would give KV for now (0 if none)."""
        with self._lock:
            entry = self._entries.get(key)
            return max(0, min(common_prefix(entry.tokens, prompt), len(prompt) - 1)) if entry is not None else 0

    def put(self, key: str, entry: KeptKV) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old.tokens)
            if len(entry.tokens) > self._budget:
                return
            self._entries[key] = entry
            self._tokens += len(entry.tokens)
            self._evict_locked(self._budget)

    def evict_to(self, limit: int) -> None:
        with self._lock:
            self._evict_locked(limit)

    def _evict_locked(self, limit: int) -> None:
        while self._tokens > limit and self._entries:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old.tokens)

    def set_budget(self, budget_tokens: int) -> None:
        with self._lock:
            self._budget = budget_tokens
            self._evict_locked(budget_tokens)

    def release(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old.tokens)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tokens = 0
