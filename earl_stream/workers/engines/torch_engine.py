"""The built-in PyTorch inference engine: continuous batching through the model's own forward.

It owns: a scheduler (`submit` queues requests, `step` advances the running batch by one token)
that admits new requests at decode-step boundaries while other rows are still decoding, and lets
finished rows leave at once (continuous batching; `continuous=False` gives batch-to-completion);
prefilling a prompt that several admitted requests share (a GRPO group) once and copying its KV to
each of them (`prefix_sharing`); per-row sampling with each request's own parameters and generator,
so a seeded row's tokens and log-probs do not depend on which rows share its batch (to ~1e-5);
reusing the KV caches kept between the turns of an episode (`cache_key`; `kv_store.KVStore`); and
one KV bound: the running batch's KV storage, the rows joining it and the kept caches stay within
`kv_budget_tokens` (`admission`: rows wait while they do not fit, so fewer run at once as contexts
grow; kept caches are evicted first; a request too large even alone is refused with
`RequestRefused`; one prefill runs at most `max_prefill_tokens` positions past its first row, which
bounds its activations). An allocation failure in a step is shed, not raised (`shedding`): the failed
step's rows are re-queued with their context so far, admission is lowered for good, and only a request
that fails alone is failed (`RequestOutOfMemory`); `oom_sheds` records each. The KV positions in use,
the running rows and the budget are Prometheus gauges. Each sampled token is handed to its request's
`on_token` (if any) at the step that sampled it: the OpenAI endpoint streams from it.
It leaves scheduling across asyncio episodes to `AsyncBatcher`, the batch layout to `running`, the
forward passes to `forward_passes`, LoRA versions to `adapters` (applied unmerged), and tokenisation to
the agent loop. CPU/fp32 is the tested configuration. Weight loads follow
`weight_swap` (`weight_swap.SwapMode`: drain, or interrupt/inplace at the next step boundary, the
swap's own logic living in `weight_swap`); every token carries the version of the forward whose logits
it was sampled from.

Forward passes go through `fast_decoder.FastDecoder` (the engine's own forward for Llama-style decoders with a
preallocated KV cache reused across steps) where the model qualifies, else through the HF model with
a `DynamicCache`; the latter admits rows into a running batch too when every layer is full attention, and
runs batch-to-completion otherwise (sliding-window cache layers cannot be re-aligned). `decode_path`
makes that choice from the model's config and modules and says why (`TorchEngine.decode_path`). Both give
the same logits to ~1e-5 (log-probs to ~1e-6).

Threads: any thread calling `generate` queues its requests and then drives `step` under one lock
until its own rows are done; rows submitted by other threads are admitted by whichever thread is
driving, so a request arriving mid-batch joins it instead of waiting for the batch to finish.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from earl_stream import metrics as M
from earl_stream.errors import EngineError
from earl_stream.model.loading import placeholder_token_ids
from earl_stream.supervisor.rollout_memory import ENGINE_MAX_PREFILL_TOKENS, ENGINE_PREFILL_CHUNK_TOKENS
from earl_stream.workers.engines.adapters import LiveAdapters
from earl_stream.workers.engines.admission import KVPlan, refusal, take_admissible
from earl_stream.workers.engines.base import EngineCapacity, FinishReason, GenerateRequest, GenerateResult, check_request
from earl_stream.workers.engines.decode_path import PathChoice, choose_path
from earl_stream.workers.engines.forward_passes import ForwardPasses
from earl_stream.workers.engines.kv_store import KVStore
from earl_stream.workers.engines.routing import RoutingRecorder
from earl_stream.workers.engines.running import Row, RunningBatch, draw_uniforms, kept_kv
from earl_stream.workers.engines.sampling import SamplingParams, sample_tokens
from earl_stream.workers.engines.shedding import OomShed, Shedder, ShedSteps, StepPhase
from earl_stream.workers.engines.static_kv import StaticKV
from earl_stream.workers.engines.vision import ENGINE_VISION_TYPES, takes_images
from earl_stream.workers.engines.weight_swap import SwapMode, SwapSteps, WeightSwapper
from earl_stream.workers.oom import is_allocation_failure, release_cached

_LOG = logging.getLogger(__name__)
_HANDOFF_S = 0.002  # how often a thread whose rows another thread is driving checks whether to take over
_COUNTERS = ("batches", "forward_calls", "prefill_tokens", "reused_tokens", "generated", "shared_prefix_tokens",
             "admitted_while_running", "peak_kv_tokens", "refused", "compactions", "swaps", "reprefill_tokens")


@dataclass(frozen=True)
class EngineStats:
    """Cumulative counters of one engine (for metrics and tests)."""

    batches: int  # admissions: prefill forwards that started rows (into a new or a running batch)
    forward_calls: int  # model forward passes (prefill + decode steps)
    prefill_tokens: int  # prompt tokens run through the model
    reused_tokens: int  # prompt tokens whose KV came from a cache kept between turns
    generated_tokens: int
    kept_cache_tokens: int  # tokens currently held in kept caches
    shared_prefix_tokens: int = 0  # prompt tokens not run because an identical prompt was admitted with them
    admitted_while_running: int = 0  # rows that joined a batch that was already decoding
    running_kv_tokens: int = 0  # KV positions the running batch holds now (rows x positions of its storage)
    peak_kv_tokens: int = 0  # most KV positions held at once (running batch, rows joining it, kept caches)
    running_rows: int = 0  # rows decoding now
    refused: int = 0  # requests refused as larger than the KV budget on their own (RequestRefused)
    swaps: int = 0  # weight versions loaded
    reprefill_tokens: int = 0  # context tokens of running rows prefilled again by interrupting swaps


class TorchEngine(SwapSteps, ShedSteps):
    """Generates with a Hugging Face causal LM, batching requests continuously (see the module docstring).

    Thread-safe: `generate`, `step` and `load_state_dict` serialise on one lock; `submit`, `release`
    and `set_capacity` do not wait for a running step.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch_size: int = 64,
        kv_budget_tokens: int = 65536,
        seed: int = 0,
        fast_forward: bool = True,
        continuous: bool = True,
        prefix_sharing: bool = True,
        max_prefill_tokens: int = ENGINE_MAX_PREFILL_TOKENS,
        weight_swap: SwapMode | str = SwapMode.DRAIN,
        batch_invariant: bool = False,
        prefill_chunk_tokens: int = ENGINE_PREFILL_CHUNK_TOKENS,
    ) -> None:
        """`fast_forward=False` always uses the HF model's forward (for comparisons and debugging);
        `continuous=False` admits requests only into an empty batch (batch-to-completion);
        `prefix_sharing=False` prefills every row's prompt separately; `max_prefill_tokens` bounds the
        prompt positions (without kept KV) one prefill runs, past its first row (0: no bound); `weight_swap`: what a
        weight load does to running rows (`weight_swap.SwapMode`); `batch_invariant`: a row's logits are bitwise the same
        whatever rows share its batch (see `set_batch_invariant`); `prefill_chunk_tokens`: a prefill runs at most
        this many positions per forward, appending to the KV chunk by chunk (`chunked_prefill`; 0: whole)."""
        _check_capacity(EngineCapacity(max_batch_size, kv_budget_tokens))
        self._vision = takes_images(model)
        # a vision-language model's image tokens are never sampled (`model.loading.placeholder_token_ids`)
        never = placeholder_token_ids(model.config) if self._vision else ()
        self._never = torch.tensor(never, dtype=torch.long) if never else None
        self._model = model.eval()
        self._capacity = EngineCapacity(max_batch_size, kv_budget_tokens)  # the plan's; `capacity`: within sheds
        self._shedder = Shedder()
        self._rng = torch.Generator().manual_seed(seed)
        self._kv = KVStore(kv_budget_tokens)
        self._lock = threading.Lock()  # held by the thread driving a step, or loading weights
        self._lora = LiveAdapters(model)  # LoRA versions, applied unmerged (the base weights never change)
        self._intake_lock = threading.Lock()
        self._intake: collections.deque[Row] = collections.deque()
        self._batch: RunningBatch | None = None
        self._live_keys: set[str] = set()
        self._admitting = True
        self._swapper = WeightSwapper(SwapMode(weight_swap))
        self._version = 0
        self._device = next(model.parameters()).device
        config = model.config.get_text_config(decoder=True)
        head = model.get_output_embeddings()
        self._vocab = int(head.weight.shape[0]) if head is not None else int(config.vocab_size)
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = pad if isinstance(pad, int) and 0 <= pad < self._vocab else 0
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        # Kept caches are re-assembled from plain per-layer tensors: only full-attention layers fit that.
        self._can_keep = all(t == "full_attention" for t in layer_types)
        if not self._can_keep:
            _LOG.warning("model has non-full-attention layers %s: KV caches are not kept between turns", layer_types)
        self._path = choose_path(model, fast_forward=fast_forward)  # before the routing hooks: it probes the model
        self._fast = self._path.decoder
        self._routing = RoutingRecorder.attach(model)  # MoE: records routed experts per fed token
        self._invariant = False
        self.set_batch_invariant(batch_invariant)
        self._continuous = continuous and (self._fast is not None or self._can_keep)  # sliding layers: cannot join
        self._passes = ForwardPasses(model, self._fast, self._device, self._routing, self._pad_id, prefix_sharing,
                                     prefill_chunk_tokens)
        self._max_prefill = max_prefill_tokens
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._layers = int(config.num_hidden_layers)
        M.ROLLOUT_KV_BUDGET_TOKENS.set(kv_budget_tokens)

    # ---------------------------------------------------------------- Engine protocol

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def capacity(self) -> EngineCapacity:
        """What admission uses: the plan's capacity, lowered by allocation failures shed so far."""
        return self._shedder.capped(self._capacity)

    @property
    def oom_sheds(self) -> tuple[OomShed, ...]:
        """Allocation failures this engine survived, oldest first (the last 256)."""
        return tuple(self._shedder.records)

    @property
    def oom_shed_total(self) -> int:
        """Allocation failures this engine survived since it started."""
        return self._shedder.total

    @property
    def decode_path(self) -> PathChoice:
        """The forward this engine decodes with and why (`decode_path.choose_path`)."""
        return self._path

    @property
    def admits_while_running(self) -> bool:
        """True when requests submitted during a batch join it (the batcher then overlaps `generate` calls)."""
        return self._continuous

    def set_capacity(self, capacity: EngineCapacity) -> None:
        """Takes effect at the next admission; shrinks the kept caches at once."""
        _check_capacity(capacity)
        self._capacity = capacity
        self._kv.set_budget(self.capacity.kv_budget_tokens)
        M.ROLLOUT_KV_BUDGET_TOKENS.set(self.capacity.kv_budget_tokens)

    def set_prefill_chunk_tokens(self, tokens: int) -> None:
        """`rollout.prefill_chunk_tokens`: the most positions one prefill forward runs from now on (0: whole)."""
        if tokens < 0:
            raise ValueError(f"prefill_chunk_tokens={tokens} must be >= 0")
        self._passes = dataclasses.replace(self._passes, chunk_tokens=tokens)

    def set_batch_invariant(self, on: bool) -> None:
        """Make every row's logits (hence its seeded tokens) independent of which rows share its batch and when
        they joined (`rollout.batch_invariant`): the fast decoder runs the fixed-shape ops of `invariant_ops`;
        through the HF forward, rows run one at a time. Not covered: a turn whose kept KV was evicted is prefilled
        again (other float rounding than reusing it), and sparse expert blocks (MoE) run on the whole batch."""
        self._invariant = on
        if self._fast is not None:
            self._fast.batch_invariant = on
        if on and self._routing is not None:
            _LOG.warning("rollout.batch_invariant: the model's sparse expert blocks still run on the whole batch, "
                         "so its rows' logits may depend on their batch in the last float bits")

    @property
    def stats(self) -> EngineStats:
        c = self._counts
        batch = self._batch
        return EngineStats(
            c["batches"], c["forward_calls"], c["prefill_tokens"], c["reused_tokens"], c["generated"], self._kv.tokens,
            c["shared_prefix_tokens"], c["admitted_while_running"], batch.held_tokens if batch else 0,
            c["peak_kv_tokens"], len(batch.rows) if batch else 0, c["refused"], c["swaps"], c["reprefill_tokens"],
        )

    @property
    def weight_swap(self) -> SwapMode:
        return self._swapper.mode

    def release(self, cache_key: str) -> None:
        self._kv.release(cache_key)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Extend every request; results in input order. Raises EngineError on a bad request or a failed step."""
        rows = self.submit(requests)
        while pending := [r for r in rows if not r.done.is_set()]:
            # Drive if nobody does; else the driving thread advances these rows too: wait for them, and
            # take over once it leaves (a blocking acquire could starve behind a driver re-acquiring).
            if self._lock.acquire(blocking=False):
                try:
                    self.step()
                finally:
                    self._lock.release()
            else:
                pending[0].done.wait(_HANDOFF_S)
        errors = [r.error for r in rows if r.error is not None]
        if errors:
            raise errors[0]
        return [r.result for r in rows if r.result is not None]

    def submit(self, requests: Sequence[GenerateRequest], on_done: Callable[[Row], None] | None = None) -> list[Row]:
        """Validate and queue requests for admission at the next step; returns their rows (wait on `done`,
        or pass `on_done`, called with each row as it finishes, from the driving thread).

        Nothing runs until some thread calls `step` or `drive` (as `generate` does)."""
        reqs = list(requests)
        for i, req in enumerate(reqs):
            if req.images and not self._vision:
                raise EngineError(f"request {i} carries {len(req.images)} image(s); this engine feeds images to "
                                  f"{ENGINE_VISION_TYPES} models only, not to {type(self._model).__name__}")
            check_request(i, req, self._vocab)
        rows = [Row(req, list(req.prompt_ids), torch.Generator().manual_seed(req.seed) if req.seed is not None else None,
                    on_done=on_done) for req in reqs]
        with self._intake_lock:
            self._intake.extend(rows)
        return rows

    def drive(self) -> None:
        """Step until no row runs and none is queued (what `AsyncBatcher` runs in its worker thread)."""
        with self._lock:
            while self._batch is not None or self._intake:
                self.step()

    def step(self) -> None:
        """One scheduler step: sample a token for every running row, let finished rows leave, feed the
        rest one token, then admit queued requests that fit. Call it with the engine lock held (as
        `generate` does) or from a single thread that owns the engine. A staged weight swap is applied first."""
        if self._swapper.pending:
            self._apply_swap()
        with torch.inference_mode():
            batch = self._batch
            try:
                if batch is not None:
                    tokens = self._sample_and_retire(batch)
                    if batch.rows:
                        self._passes.decode(batch, tokens, self._version, self._counts)
                    else:
                        self._batch = None
                self._admit()
            except (RuntimeError, MemoryError) as exc:
                if isinstance(exc, RuntimeError) and not is_allocation_failure(exc):
                    self._fail_running(exc)
                elif self._batch is not None:  # a decode step (or a compaction before admitting) failed
                    rows, self._batch = self._batch.rows, None
                    self._shed(rows, len(rows), 0, StepPhase.DECODE, exc)
                else:
                    raise
        held = (self._batch.held_tokens if self._batch else 0) + self._kv.tokens
        self._counts["peak_kv_tokens"] = max(self._counts["peak_kv_tokens"], held)
        M.ROLLOUT_KV_TOKENS_IN_USE.set(held)
        M.ROLLOUT_ADMITTED_SEQUENCES.set(len(self._batch.rows) if self._batch else 0)

    # ---------------------------------------------------------------- scheduling

    def _take_admissible(self) -> list[Row]:
        """Queued rows, oldest first, that fit next to the running batch (`admission.take_admissible`);
        rows too large for the budget even alone are refused. When the oldest waits only because the
        batch's storage still holds rows that left, the storage is compacted first. Evicts kept
        caches to make room."""
        batch = self._batch
        if not self._admitting or (batch is not None and not self._continuous):
            return []
        cap, plan = self.capacity, KVPlan(self._layers)
        if self._invariant and self._fast is None:  # the HF forward pads a batch: one row at a time is exact
            cap = EngineCapacity(1, cap.kv_budget_tokens)
        storage = batch.cache if batch is not None and isinstance(batch.cache, StaticKV) else None
        if batch is not None:
            plan = KVPlan(self._layers, storage.row_capacity if storage else len(batch.rows),
                          storage.capacity if storage else batch.length, len(batch.rows), batch.length,
                          max(r.remaining for r in batch.rows))
        with self._intake_lock:
            taken, refused, plan = take_admissible(self._intake, plan, cap, max_prefill_tokens=self._max_prefill,
                                                   new_part=self._new_part)
            tight = self._compacted(plan, cap) if not taken and self._intake and storage is not None else None
            if storage is not None and tight is not None:  # one layer re-allocated at a time: room for it first
                self._kv.evict_to(max(0, cap.kv_budget_tokens - plan.held_tokens - -(-tight.held_tokens // self._layers)))
                storage.compact(tight.room)
                self._counts["compactions"] += 1
                taken, more, plan = take_admissible(self._intake, tight, cap, max_prefill_tokens=self._max_prefill,
                                                    new_part=self._new_part)
                refused += more
            if taken:
                self._kv.evict_to(max(0, cap.kv_budget_tokens - plan.peak_tokens))
                self._counts["peak_kv_tokens"] = max(self._counts["peak_kv_tokens"], plan.peak_tokens + self._kv.tokens)
        for row in refused:
            self._counts["refused"] += 1
            M.ROLLOUT_REQUESTS_REFUSED.inc()
            error = refusal(row, cap)
            _LOG.warning("refused: %s", error)
            row.finish(error=error)
        return taken

    def _new_part(self, row: Row) -> int:
        """The prompt tokens `row` would run through the model: those its kept KV does not cover."""
        key = row.req.cache_key
        if key is None or not self._can_keep or key in self._live_keys:
            return len(row.prompt)
        return len(row.prompt) - self._kv.reusable(key, row.prompt)

    def _compacted(self, plan: KVPlan, cap: EngineCapacity) -> KVPlan | None:
        """The plan with a storage of only the live rows' positions, if the oldest queued row fits next
        to that and not next to the storage as it is (None otherwise)."""
        tight = dataclasses.replace(plan, row_capacity=plan.rows, capacity=plan.length + plan.room)
        if tight.held_tokens >= plan.held_tokens:
            return None
        head = self._intake[0]
        trial = tight.join(len(head.prompt), head.remaining, self._new_part(head))
        fits = trial.rows <= cap.max_concurrent_sequences and trial.peak_tokens <= cap.kv_budget_tokens
        return tight if fits else None

    def _admit(self) -> None:
        rows = self._take_admissible()
        if not rows:
            return
        try:
            for row in rows:
                if row.interrupted:  # its key stays live; its KV is prefilled again
                    continue
                key = row.req.cache_key if self._can_keep and row.req.cache_key not in self._live_keys else None
                row.keep_key = key
                if key is not None:
                    self._live_keys.add(key)
                    row.kept = self._kv.take(key, row.prompt)
            joining = self._passes.prefill(rows, self._version, self._counts)
        except (RuntimeError, MemoryError) as exc:
            if isinstance(exc, RuntimeError) and not is_allocation_failure(exc):
                self._fail(rows, exc)
                return
            running = len(self._batch.rows) if self._batch is not None else 0
            held = self._batch.held_tokens if self._batch is not None else 0
            self._shed(rows, running + len(rows), held, StepPhase.PREFILL, exc)
            return
        self._counts["batches"] += 1
        if self._batch is None:
            self._batch = joining
            return
        self._counts["admitted_while_running"] += len(rows)
        try:
            self._batch.join(joining, max(r.remaining for r in self._batch.rows + rows))
        except (RuntimeError, MemoryError) as exc:  # the batch may be half-joined: neither side can go on
            if isinstance(exc, RuntimeError) and not is_allocation_failure(exc):
                self._fail(rows, exc)
                raise
            both, self._batch = self._batch.rows + rows, None
            self._shed(both, len(both), 0, StepPhase.PREFILL, exc)

    def _fail_running(self, exc: RuntimeError) -> None:
        rows = self._batch.rows if self._batch is not None else []
        self._batch = None
        self._fail(rows, exc)

    def _fail(self, rows: list[Row], exc: RuntimeError) -> None:
        widest = max((len(r.prompt) + r.req.max_new_tokens for r in rows), default=0)
        error = EngineError(
            f"generation failed for a batch of {len(rows)} sequences (up to {widest} tokens each): {exc}. "
            "If memory ran out, lower max_concurrent_sequences or kv_budget_tokens."
        )
        error.__cause__ = exc
        for row in rows:
            self._live_keys.discard(row.keep_key or "")
            row.finish(error=error)

    # ---------------------------------------------------------------- forward passes

    def _sample_and_retire(self, batch: RunningBatch) -> torch.Tensor:
        """Sample one token per row; finished rows keep their KV (if keyed), get their result and leave.
        Returns the sampled tokens [B'] int64 of the rows that stay."""
        uniforms = draw_uniforms(batch.rows, self._rng).to(batch.logits.device)
        logits = batch.logits
        if self._never is not None:
            logits = logits.index_fill(1, self._never.to(logits.device), float("-inf"))
        tokens, logprobs = sample_tokens(logits, SamplingParams.of([r.req for r in batch.rows]), uniforms)
        stay = []
        for j, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            row = batch.rows[j]
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(row.logits_version)
            if row.req.on_token is not None:
                _observe(row.req.on_token, tok)
            if tok in row.req.stop_token_ids:
                row.reason = FinishReason.STOP
            elif len(row.tokens) >= row.req.max_new_tokens:
                row.reason = FinishReason.LENGTH
            if row.reason is None:
                stay.append(j)
                continue
            # its copy is made while the batch still holds the row: kept only if both fit the budget
            room = self.capacity.kv_budget_tokens - batch.held_tokens - (row.fed - 1)
            if row.keep_key is not None and room >= 0 and not row.stale_kv:
                self._keep(row, batch, j, room)
            self._live_keys.discard(row.keep_key or "")
            routed = self._routing.result(row) if self._routing is not None else None
            mixed = len(set(row.versions)) > 1
            row.finish(GenerateResult(row.tokens, row.logprobs, row.reason, row.versions[0],
                                      routed_experts=routed, token_versions=list(row.versions) if mixed else None))
        self._counts["generated"] += len(batch.rows)
        if len(stay) < len(batch.rows):
            batch.keep_rows(stay)
            tokens = tokens[stay]
            if stay:  # else the batch ends and its storage is freed: the kept caches may use the whole budget
                self._kv.evict_to(max(0, self.capacity.kv_budget_tokens - batch.held_tokens))
        return tokens

    def _keep(self, row: Row, batch: RunningBatch, j: int, room: int) -> None:
        """Keep finished row `j`'s KV for its episode's next turn; an allocation failure only loses the reuse."""
        assert row.keep_key is not None
        self._kv.evict_to(room)
        try:
            self._kv.put(row.keep_key, kept_kv(row, batch.cache, batch.mask, j))
        except (RuntimeError, MemoryError) as exc:
            if isinstance(exc, RuntimeError) and not is_allocation_failure(exc):
                raise
            release_cached(exc, self._device)
            _LOG.warning("KV of a finished turn not kept (%s): the next turn prefills it again", exc)


def _observe(on_token: Callable[[int], None], token: int) -> None:
    """A request's token observer; its failure must not fail the other rows of the batch."""
    try:
        on_token(token)
    except Exception:  # the observer's bug: logged, the row goes on
        _LOG.exception("a request's on_token callback failed")


def _check_capacity(capacity: EngineCapacity) -> None:
    if capacity.max_concurrent_sequences < 1 or capacity.kv_budget_tokens < 1:
        raise EngineError(f"invalid engine capacity {capacity}: both values must be >= 1")
