"""Admission control of the built-in engine: which queued requests join the running batch now.

Owns `KVPlan` (the KV positions a running batch holds, will hold and holds at most while rows join
it) and `take_admissible` (the oldest queued requests that fit, and the ones that cannot fit even
alone, refused with `base.RequestRefused`). The batch layout it counts is `running`'s, the forward
passes `torch_engine`'s.

What is counted, in KV positions (tokens; bytes = tokens x 2 x layers x kv_heads x head_dim x
element bytes). A batch's storage is [rows, capacity] per layer, every row padded to the longest:
holding `rows` rows of `length` positions with `room` more to come takes rows x (length + room).
Rows join through a prefill cache of their own, [new rows, longest prompt + most new tokens], which
is alive while it is copied into the batch storage; if that storage must grow, it is re-allocated
(exactly) one layer at a time, old and new side by side for that layer. So admitting rows needs

    peak = max(held, after) + joining (+ after / layers when the storage grows)

and an engine admits only while that, plus the kept caches (evicted first), stays within
`kv_budget_tokens`. As contexts grow, each row costs more and fewer rows run at once; a request
whose prompt + max_new_tokens exceed the budget on its own is refused, never run out of memory.
Prefill activations are not KV: the rollout selector takes them off the budget before it sizes the KV
(`supervisor.rollout_memory`), and the engine bounds them by admitting, past the first row, at most
`max_prefill_tokens` prompt positions (those without kept KV) per prefill.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

from earl_stream.workers.engines.base import EngineCapacity, RequestRefused
from earl_stream.workers.engines.running import Row


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """A running batch and the rows joining it, in KV positions (see the module docstring).

    `row_capacity` x `capacity`: the batch storage now (0 x 0: no batch); `rows`, `length`, `room`:
    live rows after the join, their common length and the most positions any of them still needs;
    `new_rows` joining rows, their longest prompt `new_width` and most new tokens `new_room`."""

    layers: int
    row_capacity: int = 0
    capacity: int = 0
    rows: int = 0
    length: int = 0
    room: int = 0
    new_rows: int = 0
    new_width: int = 0
    new_room: int = 0
    new_part: int = 0  # the most prompt tokens any joining row runs through the model (no kept KV for them)

    @property
    def held_tokens(self) -> int:
        return self.row_capacity * self.capacity

    @property
    def joining_tokens(self) -> int:
        """The joining rows' prefill cache."""
        return self.new_rows * (self.new_width + self.new_room)

    @property
    def prefill_tokens(self) -> int:
        """Token positions the joining rows' prefill forward runs (rows x their longest new part, at most)."""
        return self.new_rows * self.new_part

    @property
    def grows(self) -> bool:
        return self.held_tokens > 0 and (self.rows > self.row_capacity or self.length + self.room > self.capacity)

    @property
    def after_tokens(self) -> int:
        """The storage once the rows joined (and ran their prefill, if there was no batch)."""
        if self.held_tokens == 0:
            return self.joining_tokens
        return self.rows * (self.length + self.room) if self.grows else self.held_tokens

    @property
    def peak_tokens(self) -> int:
        """The most KV positions held while the rows join."""
        if self.held_tokens == 0:
            return self.joining_tokens
        layer = -(-self.after_tokens // self.layers) if self.grows else 0
        return max(self.held_tokens, self.after_tokens) + self.joining_tokens + layer

    def join(self, prompt: int, max_new_tokens: int, new_part: int | None = None) -> KVPlan:
        """This plan with one more joining row of `prompt` tokens (`new_part` of them without kept KV: all
        when None) and up to `max_new_tokens` new ones."""
        return dataclasses.replace(self, rows=self.rows + 1, length=max(self.length, prompt),
                                   room=max(self.room, max_new_tokens), new_rows=self.new_rows + 1,
                                   new_width=max(self.new_width, prompt), new_room=max(self.new_room, max_new_tokens),
                                   new_part=max(self.new_part, prompt if new_part is None else new_part))


def refusal(row: Row, capacity: EngineCapacity) -> RequestRefused:
    need = len(row.prompt) + row.remaining
    return RequestRefused(f"a request of {len(row.prompt)} prompt + {row.remaining} new tokens needs {need} "
                          f"KV tokens on its own; the engine's KV budget is {capacity.kv_budget_tokens} tokens "
                          "(the rollout plan's, from the engine's memory and rollout.dtype)")


def take_admissible(intake: collections.deque[Row], plan: KVPlan, capacity: EngineCapacity, *,
                    max_prefill_tokens: int = 0,
                    new_part: Callable[[Row], int] | None = None) -> tuple[list[Row], list[Row], KVPlan]:
    """Pop from `intake`, oldest first, the rows that fit next to the running batch described by
    `plan`: at most `max_concurrent_sequences` live rows and a peak within `kv_budget_tokens`, and (past
    the first) at most `max_prefill_tokens` positions in their prefill (0: no bound; `new_part(row)`:
    the prompt tokens a row runs through the model, its whole prompt when None): that bounds the
    prefill's activations, which the KV budget does not count. Stops at the first that does not fit
    (it waits for rows to finish, or for the next step). Rows that cannot fit even alone are popped as
    refused. Returns (admitted, refused, the plan with the admitted rows)."""
    taken: list[Row] = []
    refused: list[Row] = []
    while intake:
        row = intake[0]
        if len(row.prompt) + row.remaining > capacity.kv_budget_tokens:  # remaining: all new tokens, but after a re-prefill
            refused.append(intake.popleft())
            continue
        trial = plan.join(len(row.prompt), row.remaining, new_part(row) if new_part else None)
        if trial.rows > capacity.max_concurrent_sequences or trial.peak_tokens > capacity.kv_budget_tokens:
            break
        if taken and max_prefill_tokens and trial.prefill_tokens > max_prefill_tokens:
            break
        taken.append(intake.popleft())
        plan = trial
    return taken, refused, plan
