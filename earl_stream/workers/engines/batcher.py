"""Batching across asyncio episodes: many coroutines share one blocking `Engine`.

It owns the queue of waiting requests, the decision of when a batch starts (as soon as
`max_batch_size` requests wait, or `max_wait_s` after the oldest one arrived), running the engine
in a worker thread so that the event loop (environments, control-plane I/O) keeps running, and
serialising "exclusive" work such as a weight load between batches. With an engine that admits
requests into a running batch (`admits_while_running` with `submit(requests, on_done)` and `drive()`:
the built-in engine's continuous batching), each batch is handed to the engine's queue at once, one
worker thread drives the engine while it has work, and every request resolves as soon as its own
row finishes; exclusive work waits until the engine is idle. With any other engine a batch runs to
completion and requests arriving meanwhile form the next one. What happens inside a batch is the
engine's business.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import Engine, GenerateRequest, GenerateResult, RequestRefused

_LOG = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Waiting:
    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    arrived: float  # loop.time() at submission
    gather_quiet_s: float = 0.0  # see AsyncBatcher.generate
    gather_max_s: float = 0.0
    all_here: Callable[[], bool] | None = None


@dataclass
class _Exclusive:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]


def _fail(batch: list[_Waiting], exc: Exception) -> None:
    for waiting in batch:
        if not waiting.future.done():
            waiting.future.set_exception(exc)


class AsyncBatcher:
    """Collects concurrent `generate` calls into `engine.generate(batch)` calls run in a worker thread.

    Use it from one event loop. Exceptions raised by the engine fail exactly the requests of the
    batch that raised; later batches run normally.
    """

    def __init__(self, engine: Engine, *, max_batch_size: int = 64, max_wait_s: float = 0.002,
                 join_running: bool = True) -> None:
        """`join_running=False`: every batch runs to completion even on an engine that admits requests
        while running (rollout.join_running_batch)."""
        if max_batch_size < 1 or max_wait_s < 0:
            raise EngineError(
                f"AsyncBatcher needs max_batch_size >= 1 and max_wait_s >= 0, got {max_batch_size}, {max_wait_s}"
            )
        self._engine = engine
        self._max_batch = max_batch_size
        self._max_wait = max_wait_s
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._exclusive: collections.deque[_Exclusive] = collections.deque()
        self._running: list[_Waiting] = []
        self._continuous = join_running and bool(getattr(engine, "admits_while_running", False))
        self._submitted: dict[int, _Waiting] = {}  # continuous: by id() of the engine's row
        self._driver: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._closed = False
        self._batches = 0
        self._requests = 0

    @property
    def batches_run(self) -> int:
        """Engine batches completed or failed so far."""
        return self._batches

    @property
    def requests_run(self) -> int:
        """Requests handed to the engine so far."""
        return self._requests

    @property
    def waiting(self) -> int:
        """Requests queued and not yet in a batch."""
        return len(self._waiting)

    async def generate(self, request: GenerateRequest, *, gather_quiet_s: float = 0.0, gather_max_s: float = 0.0,
                       all_here: Callable[[], bool] | None = None) -> GenerateResult:
        """Extend one sequence; returns when the batch it joined has finished (with a continuous engine:
        as soon as its own row has).

        With `gather_quiet_s > 0` the batch this request joins also waits while other requests keep
        arriving (no gap longer than `gather_quiet_s`), for at most `gather_max_s` after this one
        arrived, and not once `all_here()` says no more are expected: requests that come in one by
        one (HTTP clients, each with its own per-call cost) then share one batch instead of
        splitting into many small ones.
        """
        loop = self._start()
        future: asyncio.Future[GenerateResult] = loop.create_future()
        self._waiting.append(_Waiting(request, future, loop.time(), gather_quiet_s, gather_max_s, all_here))
        self._wake()
        return await future

    async def run_exclusive(self, fn: Callable[[], T | Awaitable[T]]) -> T:
        """Run `fn` between batches (never during one) and return its result.

        A plain callable runs in a worker thread; a coroutine function runs on the loop. Exclusive
        work queued before the next batch starts runs first.
        """
        loop = self._start()
        future: asyncio.Future[Any] = loop.create_future()
        self._exclusive.append(_Exclusive(fn, future))
        self._wake()
        return cast(T, await future)

    def release(self, cache_key: str) -> None:
        """Forget the KV cache the engine keeps for an episode (call it when the episode ends).

        Passed straight to the engine: `Engine.release` must not wait for a running batch.
        """
        self._engine.release(cache_key)

    def close(self) -> None:
        """Stop at once: waiting, running and exclusive calls fail with EngineError. Idempotent.

        A batch already inside the engine thread runs to its end, but its results are dropped.
        """
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self._fail_all(EngineError("AsyncBatcher was closed before this request ran"))

    async def aclose(self) -> None:
        """Stop gracefully: the running batch finishes and delivers; queued work fails with EngineError."""
        if self._closed:
            return
        self._stopping = True
        self._fail_queued(EngineError("AsyncBatcher was closed before this request ran"))
        self._wake()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._closed = True

    # ---------------------------------------------------------------- internals

    def _start(self) -> asyncio.AbstractEventLoop:
        if self._closed or self._stopping:
            raise EngineError("AsyncBatcher is closed; create a new one")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._run(), name="earl-engine-batcher")
        elif self._loop is not loop:
            raise EngineError("AsyncBatcher used from a second event loop; use one batcher per loop")
        return loop

    def _wake(self) -> None:
        if self._wakeup is not None:  # None: never started (an aclose before any request)
            self._wakeup.set()

    async def _run(self) -> None:
        assert self._wakeup is not None
        try:
            while not self._stopping:
                await self._wakeup.wait()
                self._wakeup.clear()
                while (self._exclusive or self._waiting) and not self._stopping:
                    if self._exclusive:
                        await self._drain()
                        await self._run_one_exclusive(self._exclusive.popleft())
                        continue
                    batch = await self._collect()
                    if batch:
                        await self._dispatch(batch)
            await self._drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave callers waiting forever
            _LOG.exception("engine batcher stopped")
            self._closed = True
            self._fail_all(EngineError(f"engine batcher stopped: {exc!r}"))

    async def _collect(self) -> list[_Waiting]:
        """Wait until a full batch waits or the oldest waited max_wait_s; take up to max_batch_size."""
        assert self._wakeup is not None and self._loop is not None
        self._drop_cancelled()
        while self._waiting and len(self._waiting) < self._max_batch and not self._exclusive:
            remaining = self._start_at() - self._loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                break
            self._drop_cancelled()
        if self._exclusive or self._stopping:
            return []
        count = min(len(self._waiting), self._max_batch)
        return [self._waiting.popleft() for _ in range(count)]

    def _start_at(self) -> float:
        """When the next batch starts: max_wait_s after the oldest request, or later while requests
        that asked to gather (`generate`'s gather_*) keep arriving, up to their limit."""
        start = self._waiting[0].arrived + self._max_wait
        gathering = [w for w in self._waiting if w.gather_quiet_s > 0]
        if gathering and not any(w.all_here is not None and w.all_here() for w in gathering):
            quiet = max(w.gather_quiet_s for w in gathering)
            cap = min(w.arrived + w.gather_max_s for w in gathering)
            start = max(start, min(cap, self._waiting[-1].arrived + quiet))
        return start

    async def _dispatch(self, batch: list[_Waiting]) -> None:
        """Run the batch now, or (continuous engine) queue it in the engine and return to collecting."""
        if not self._continuous:
            await self._run_batch(batch)
            return
        loop = asyncio.get_running_loop()

        def on_done(row: Any) -> None:  # in the driving thread
            try:
                loop.call_soon_threadsafe(self._deliver, row)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        self._batches += 1
        self._requests += len(batch)
        try:
            rows = cast(Any, self._engine).submit([w.request for w in batch], on_done)
        except Exception as exc:  # a rejected request fails exactly this batch's callers
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
            return
        for row, waiting in zip(rows, batch):
            self._submitted[id(row)] = waiting
            self._running.append(waiting)
        self._ensure_driver()

    def _ensure_driver(self) -> None:
        """One worker thread drives the engine while rows are outstanding; restarted if it ended just
        before rows came in (it saw an empty queue)."""
        if self._driver is not None or not self._submitted or self._closed:
            return
        self._driver = asyncio.get_running_loop().create_task(
            asyncio.to_thread(cast(Any, self._engine).drive), name="earl-engine-driver")
        self._driver.add_done_callback(self._driver_done)

    def _driver_done(self, task: asyncio.Task[None]) -> None:
        self._driver = None
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            _LOG.error("engine driver failed: %r", exc)
            self._fail_submitted(exc if isinstance(exc, Exception) else EngineError(repr(exc)))
            return
        self._ensure_driver()

    def _deliver(self, row: Any) -> None:
        waiting = self._submitted.pop(id(row), None)
        if waiting is None:
            return
        self._running = [w for w in self._running if w is not waiting]
        if waiting.future.done():
            return
        if row.error is not None:
            waiting.future.set_exception(row.error)
        else:
            waiting.future.set_result(row.result)

    def _fail_submitted(self, exc: Exception) -> None:
        for waiting in self._submitted.values():
            if not waiting.future.done():
                waiting.future.set_exception(exc)
        self._submitted.clear()

    async def _drain(self) -> None:
        """Wait until the engine has no row of ours (continuous engines; a no-op otherwise)."""
        while self._driver is not None or self._submitted:
            if self._driver is not None:
                await asyncio.wait({self._driver})
            else:
                await asyncio.sleep(0.001)  # deliveries scheduled by the driving thread are on their way

    async def _run_batch(self, batch: list[_Waiting]) -> None:
        self._running = batch
        self._requests += len(batch)
        try:
            results = await asyncio.to_thread(self._engine.generate, [w.request for w in batch])
            if len(results) != len(batch):
                raise EngineError(f"engine returned {len(results)} results for {len(batch)} requests")
        except RequestRefused as exc:
            if len(batch) == 1:
                _fail(batch, exc)
                return
            # an engine that checks a whole batch before running it refuses all for one request too large:
            # run each alone, so that only that one is refused
            self._requests -= len(batch)
            for waiting in batch:
                await self._run_batch([waiting])
        except Exception as exc:  # the engine's failure belongs to exactly this batch's callers
            _LOG.warning("engine batch of %d requests failed: %r", len(batch), exc)
            _fail(batch, exc)
        else:
            for waiting, result in zip(batch, results):
                if not waiting.future.done():
                    waiting.future.set_result(result)
        finally:
            self._running = []
            self._batches += 1

    async def _run_one_exclusive(self, item: _Exclusive) -> None:
        if item.future.done():
            return
        try:
            if inspect.iscoroutinefunction(item.fn):
                result = await item.fn()
            else:
                result = await asyncio.to_thread(item.fn)
                if inspect.isawaitable(result):
                    result = await result
        except Exception as exc:
            if not item.future.done():
                item.future.set_exception(exc)
        else:
            if not item.future.done():
                item.future.set_result(result)

    def _drop_cancelled(self) -> None:
        if any(w.future.done() for w in self._waiting):
            self._waiting = collections.deque(w for w in self._waiting if not w.future.done())

    def _fail_queued(self, exc: Exception) -> None:
        for waiting in self._waiting:
            if not waiting.future.done():
                waiting.future.set_exception(exc)
        for item in self._exclusive:
            if not item.future.done():
                item.future.set_exception(exc)
        self._waiting.clear()
        self._exclusive.clear()

    def _fail_all(self, exc: Exception) -> None:
        self._fail_queued(exc)
        for waiting in self._running:
            if not waiting.future.done():
                waiting.future.set_exception(exc)
