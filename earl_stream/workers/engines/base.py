"""The inference-engine plug-in contract shared by every backend (built-in torch, vLLM, SGLang).

It owns the request/result types, the `Engine` Protocol, the checks every backend makes of a request
(`check_request`) and `RequestRefused` (a request too large for the engine's capacity). It leaves
batching across asyncio episodes to `batcher.AsyncBatcher`, and everything about how tokens are
computed to the backends.

Log-prob convention (what the trainer's importance ratios rely on): `GenerateResult.logprobs[i]` is
the natural-log probability of `token_ids[i]` under the distribution it was actually sampled from,
i.e. `log_softmax(logits / temperature)` after top-k then top-p filtering, renormalised. With
`temperature == 0` (greedy) it is `log_softmax(logits)` of the argmax token.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from earl_stream.env.images import Image
from earl_stream.errors import EngineError


class RequestRefused(EngineError):
    """A request the engine cannot serve at its current capacity even alone (its prompt plus
    `max_new_tokens` exceed the KV budget): refused before it runs, never a crash. The message says
    what it needs and what the engine has; the agent loop ends its episode as too long."""


class FinishReason(enum.Enum):
    """Why a sequence stopped growing."""

    STOP = "stop"  # a stop token was sampled (it is the last entry of token_ids)
    LENGTH = "length"  # max_new_tokens were generated without a stop token


@dataclass(frozen=True)
class PromptImage:
    """An image in a request's prompt: positions [start, start + tokens) of `prompt_ids` are its image tokens,
    which the model's vision tower fills from `inputs` (the processor's tensors for this image alone, e.g.
    Idefics3's pixel_values [1, 3, H, W] and pixel_attention_mask [1, H, W]). `key` names its pixels (a hash of
    its PNG bytes): prompts share a prefill only where their token ids and image keys are equal. `picture` is the
    image itself, for a backend that runs its own processor (vLLM)."""

    start: int
    tokens: int
    inputs: Mapping[str, torch.Tensor] = field(compare=False, repr=False)
    key: bytes = b""
    picture: Image | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GenerateRequest:
    """One sequence to extend.

    `prompt_ids` is always the FULL context (every turn so far), so a backend without a cache is
    still correct. `cache_key` names an episode whose KV cache a backend may keep between its turns;
    two requests with the same key must not be in flight at the same time.
    `top_k == 0` and `top_p == 1.0` disable those filters; `seed` makes sampling of this request
    deterministic regardless of which other requests share its batch.

    `images`: the images whose tokens `prompt_ids` holds (all of them, in order: like the ids, the full context);
    a backend runs the vision tower only for those past the KV it kept.

    `on_token(token_id)`, when given, is called with each token as soon as it is sampled, in order
    (stop token included), before the result is delivered; it runs in the thread that drives the
    engine, so it must only hand the token over (e.g. `loop.call_soon_threadsafe`) and never raise.
    The built-in engine calls it at every decode step; backends that only return whole turns (vLLM
    and SGLang through their blocking `generate`) never call it, so a caller streaming from them gets
    its tokens with the result.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    cache_key: str | None = None
    on_token: Callable[[int], None] | None = field(default=None, compare=False, repr=False)
    images: tuple[PromptImage, ...] = ()  # every image of prompt_ids, in order (a vision-language model's)


@dataclass(frozen=True)
class GenerateResult:
    """The generated continuation: `token_ids` and `logprobs` have the same length (stop token included).

    `policy_version` is the version of the weights that produced these tokens (None if the backend
    does not say). Read it here rather than from the engine afterwards: a weight load may run between
    the end of the batch and the moment the waiting coroutine resumes. A turn whose tokens span a
    weight swap (`rollout.weight_swap` interrupt or inplace) says per token in `token_versions` (same
    length as `token_ids`; `policy_version` is then its first token's); None: all are `policy_version`.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int | None = None
    # MoE models on an engine that records routing: [len(prompt) + len(token_ids), layers, top_k] experts
    # per fed token (records.ROUTED_EXPERTS; engines.routing); None otherwise
    routed_experts: np.ndarray | None = None
    token_versions: list[int] | None = None

    def versions(self, default: int) -> list[int]:
        """The version of each token: `token_versions`, else `policy_version` (or `default`) for all."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.policy_version if self.policy_version is not None else default] * len(self.token_ids)


@dataclass(frozen=True)
class EngineCapacity:
    """Knobs the parallelism selector sets on a rollout engine.

    `max_concurrent_sequences` bounds the rows of one forward batch; `kv_budget_tokens` bounds the
    tokens whose KV the engine holds at once (the running batch plus caches kept between turns).
    """

    max_concurrent_sequences: int
    kv_budget_tokens: int


@runtime_checkable
class Engine(Protocol):
    """What a rollout worker needs from an inference backend."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Extend every request; one result per request, in input order. Blocking."""
        ...

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place (no process reload) and drop every kept KV cache."""
        ...

    def release(self, cache_key: str) -> None:
        """Forget the KV cache kept under `cache_key` (unknown keys are ignored).

        Called from the event loop while a batch may be running in another thread: it must be
        thread-safe and must not wait for that batch.
        """
        ...

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (0 before the first load)."""
        ...

    @property
    def capacity(self) -> EngineCapacity:
        """The current capacity knobs."""
        ...

    def set_capacity(self, capacity: EngineCapacity) -> None:
        """Adopt new capacity knobs (between batches)."""
        ...


def check_request(i: int, req: GenerateRequest, vocab_size: int, max_len: int = 0) -> None:
    """Raise EngineError if request `i` cannot be served (every backend's rules), RequestRefused if it
    is longer than a context of `max_len` tokens (0: the built-in engine, whose admission refuses it)."""
    where = f"request {i}"
    if len(req.prompt_ids) == 0:
        raise EngineError(f"{where}: prompt_ids is empty; it must hold the full context (>= 1 token)")
    if req.max_new_tokens < 1:
        raise EngineError(f"{where}: max_new_tokens={req.max_new_tokens}, must be >= 1")
    if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
        raise EngineError(
            f"{where}: temperature={req.temperature} (>= 0), top_p={req.top_p} (in (0, 1]), "
            f"top_k={req.top_k} (>= 0): a value is out of range"
        )
    lo, hi = min(req.prompt_ids), max(req.prompt_ids)
    if lo < 0 or hi >= vocab_size:
        raise EngineError(f"{where}: prompt token ids span [{lo}, {hi}], outside the vocabulary [0, {vocab_size})")
    end = 0
    for k, img in enumerate(req.images):
        if img.start < end or img.tokens < 1 or img.start + img.tokens > len(req.prompt_ids):
            raise EngineError(f"{where}: image {k} spans positions [{img.start}, {img.start + img.tokens}), which "
                              f"overlap the previous image or leave the {len(req.prompt_ids)}-token prompt")
        end = img.start + img.tokens
    if max_len and len(req.prompt_ids) + req.max_new_tokens > max_len:  # refused, not failed: its episode ends too long
        raise RequestRefused(
            f"{where}: {len(req.prompt_ids)} prompt + {req.max_new_tokens} new tokens exceed the engine's "
            f"context of {max_len} tokens (kv_budget_tokens or the model's max_position_embeddings)"
        )
