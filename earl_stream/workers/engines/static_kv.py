"""The fast decoder's KV cache (`StaticKV`): per layer [rows, kv_heads, capacity, head_dim] buffers, preallocated
and written in place, shared by every row of a left-padded batch.

It owns the storage's growth, compaction, row selection and joining; it exposes the same
`.layers[i].keys/.values/.batch_select_indices` surface the engine uses on a DynamicCache. It leaves the
forward pass to `fast_decoder` and the batch layout (masks, positions) to `running`.
"""

from __future__ import annotations

import torch


class _StaticLayer:
    """One layer's K/V storage [rows_capacity, kv_heads, capacity, head_dim]; `k_buf`/`v_buf` are the
    live rows' part [B, ...] and `keys`/`values` its filled positions [B, kv_heads, length, head_dim]."""

    def __init__(self, owner: StaticKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._owner = owner
        self.k_store = keys
        self.v_store = values

    @property
    def k_buf(self) -> torch.Tensor:
        return self.k_store[: self._owner.rows]

    @property
    def v_buf(self) -> torch.Tensor:
        return self.v_store[: self._owner.rows]

    @property
    def keys(self) -> torch.Tensor:
        return self.k_buf[:, :, : self._owner.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v_buf[:, :, : self._owner.length]

    def batch_select_indices(self, idx: torch.Tensor) -> None:
        """Keep the rows `idx` [B'] int64 (repeats allowed). Written in place while they fit the storage."""
        for name in ("k_store", "v_store"):
            store = getattr(self, name)
            picked = store[: self._owner.rows].index_select(0, idx)
            if idx.numel() <= store.shape[0]:
                store[: idx.numel()] = picked
            else:
                setattr(self, name, picked)


class StaticKV:
    """A batch's KV cache: all rows share one length (the batch is left-padded).

    The storage is preallocated and reused step after step: appending a token writes in place,
    dropping rows compacts them in place, admitting rows (`append_rows`) writes after the live ones;
    it grows (doubling) only when the positions or the rows outgrow it. Padding positions always
    hold finite values (zeros or stale KV), which the attention mask hides.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.length = 0
        self.rows = batch
        self.layers = [_StaticLayer(self, torch.zeros(shape, dtype=dtype, device=device),
                                    torch.zeros(shape, dtype=dtype, device=device)) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self.layers[0].k_store.shape[2]

    @property
    def row_capacity(self) -> int:
        return self.layers[0].k_store.shape[0]

    @property
    def held_tokens(self) -> int:
        """Token positions of the storage (rows x positions): what this cache holds in memory."""
        return self.row_capacity * self.capacity

    def reserve(self, tokens: int, rows: int = 0, *, exact: bool = False) -> None:
        """Make room for `tokens` more positions and `rows` more rows. Positions grow by doubling (appends
        stay amortised O(1)) and rows exactly; with `exact` (the caller knows the final size: a join) a
        storage that must grow is re-allocated to exactly the live rows + `rows` x length + `tokens`,
        dropping rows and positions no longer used (the engine's admission counts that size). One layer
        is re-allocated at a time: old and new storage coexist for that layer only."""
        need_len, need_rows = self.length + tokens, self.rows + rows
        if need_len <= self.capacity and need_rows <= self.row_capacity:
            return
        if exact:
            self._reallocate(need_rows, need_len)
            return
        new_cap = self.capacity if need_len <= self.capacity else max(need_len, 2 * self.capacity)
        self._reallocate(max(need_rows, self.row_capacity), new_cap)

    def compact(self, room: int) -> None:
        """Shrink the storage to exactly the live rows x (length + `room`) positions, freeing what rows
        that left and positions no row will use held (one layer at a time, as `reserve`)."""
        if self.rows * (self.length + room) < self.held_tokens:
            self._reallocate(self.rows, self.length + room)

    def _reallocate(self, new_rows: int, new_cap: int) -> None:
        for layer in self.layers:
            for name in ("k_store", "v_store"):
                old = getattr(layer, name)
                grown = old.new_zeros((new_rows, old.shape[1], new_cap, old.shape[3]))
                grown[: self.rows, :, : self.length] = old[: self.rows, :, : self.length]
                setattr(layer, name, grown)

    def select_rows(self, idx: torch.Tensor) -> None:
        """Keep the rows `idx` [B'] int64 in that order; a repeated index copies a row (a shared prefix)."""
        self.reserve(0, max(0, idx.numel() - self.rows))
        for layer in self.layers:
            layer.batch_select_indices(idx)
        self.rows = idx.numel()

    def append_rows(self, other: StaticKV, room: int = 0) -> int:
        """Add `other`'s rows after the live ones, right-aligned at the longer of the two lengths, with
        room for `room` more positions after it (allocated exactly).

        Returns the left padding (positions) added to the rows that were already here: their masks
        must grow by as much on the left; `other`'s rows get `max(length) - other.length`.
        """
        width = max(self.length, other.length)
        shift = width - self.length
        self.reserve(shift + room, other.rows, exact=True)
        for mine, theirs in zip(self.layers, other.layers):
            for name in ("k_store", "v_store"):
                store, src = getattr(mine, name), getattr(theirs, name)
                if shift:
                    store[: self.rows, :, shift:width] = store[: self.rows, :, : self.length].clone()
                rows = slice(self.rows, self.rows + other.rows)
                store[rows, :, width - other.length : width] = src[: other.rows, :, : other.length]
        self.length = width
        self.rows += other.rows
        return shift

    def trim_left(self, positions: int) -> None:
        """Drop the first `positions` positions of every row (the caller checked they are padding for all)."""
        if positions <= 0:
            return
        keep = self.length - positions
        for layer in self.layers:
            for name in ("k_store", "v_store"):
                store = getattr(layer, name)
                store[: self.rows, :, :keep] = store[: self.rows, :, positions : self.length].clone()
        self.length = keep

