"""The built-in rollout engine's transient memory: what its prefill and decode steps allocate beyond weights and KV.

Owns `EngineTransient` and `engine_transient` (bytes per device, from the `ModelShape`, the engine's dtype and its
batch limits), `ENGINE_MAX_PREFILL_TOKENS` (the engine's bound on the prompt positions one prefill runs past its
first row, `torch_engine.TorchEngine(max_prefill_tokens=)`) and `ENGINE_PREFILL_CHUNK_TOKENS` (the default of
`rollout.prefill_chunk_tokens`: the positions one prefill forward runs at once, `engines.chunked_prefill`). The
rollout selector subtracts the peak from the engine's budget before it sizes the KV cache (`rollout_selector`);
the KV cache itself is `memory_model`'s.

What the engine (`fast_decoder.FastDecoder`, `forward_passes`, `sampling`) holds at once, in elements of the engine
dtype (e bytes) unless said otherwise; h = hidden, I = MLP width, H / Hkv / D = heads / kv heads / head_dim (heads
and I split by tp), V = vocabulary:

    per position inside a layer  a = max(4h + 2I + (H + 2 Hkv) D + 3 (H + Hkv) D    attention: residual, its norm,
                                             + 2 H D [Hkv < H],                     the previous layer's output and
                                         3h + 4I)                                   gate/up, fused q/k/v, rotary
                                      + 2D                                           temporaries, K/V repeated to
                                                                                     every query head (GQA); MLP:
                                                                                     old and new gate/up, act(gate),
                                                                                     act x up; rotary cos/sin
    prefill (P positions, one forward, keys up to L = the design length; only the last position's logits):
        P a e  +  P L (2 + e)  +  R V (e + 8)
        (two boolean causal/padding masks [B, 1, n, L] at once while the engine builds them and the e-byte bias
        SDPA's kernels take; logits [R, V] in e, their fp32 copy, the shared-prefix gather in fp32)
    decode (R rows, one position each, keys up to L):
        max(R a e + 2 R H L e + R V (e + 4),   the forward: scores [R, H, L] and their softmax, logits and fp32 copy
            32 R V)                            sampling: scaled/filtered/sorted copies (int64 order) of [R, V] fp32
    held across steps: the running batch's fp32 logits, 4 R V

    peak = held + max(prefill, decode)

P = min(max(L, max_prefill_tokens), R L): the first row's prompt runs whole, rows past it at most
`max_prefill_tokens` positions together (0: no bound); with chunks of C = `prefill_chunk_tokens` (> 0) positions
the forward holds one chunk at a time, P = min(that, max(C, rows of the prefill)) (a chunk of B rows is C // B
columns wide, at least 1, `chunked_prefill.chunk_bounds`), and its masks still reach keys up to L; R = the rows
the engine runs at once (rollout.max_batch_size, at most what its KV budget holds at the design length). Attention
on the fast decoder's SDPA path takes a workspace per query block, not a [n, L] score matrix; the batch-invariant
path (`invariant_ops`; its chunks are chunk_tokens columns of every row) and the HF forward are not modelled
separately. Checked against the real engine on CPU (fp32, h 256, I 1024, 2 layers, 4/2 heads: one prefill
of n tokens, RSS high-water growth over weights, KV included): 2048 -> 76.4 MB measured, 4096 -> 204 MB (fit:
24.8 KB per position + 6.1 bytes per query-key pair; the formula gives 23.5 KB and 6: 73.4 and 197 MB); below
~1K positions the measured peak carries 4-13 MB the formula does not (allocator and thread scratch: the reserve's).
In chunks (`bench/rollout_memory.py --prefill`, 3 runs at commit 39698bc; the result is in git at ec8e9e0, see
docs/history.md): C 512 -> 28.1 MiB measured against 20.5 predicted at 2048, 37.8 against 30.5 at 4096 (whole:
72.7 and 192); C 1024 -> 46.5 / 37.0 and 68.7 / 53.0; the chunked peaks carry 7-16 MiB the formula does not
(the same scratch, and freed chunks' blocks the allocator keeps resident).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from earl_stream.supervisor.model_shape import ModelShape

ENGINE_MAX_PREFILL_TOKENS = 8192  # the built-in engine's default max_prefill_tokens
ENGINE_PREFILL_CHUNK_TOKENS = 512  # rollout.prefill_chunk_tokens' default (see the config field for why)
_MASK_BYTES = 2  # bool bytes per query-key pair of the masks the fast decoder builds (before SDPA's e-byte bias)
_SAMPLE_BYTES = 32  # bytes per [row, vocab] element sampling holds at once (fp32 copies, int64 sort order, bools)


@dataclass(frozen=True)
class EngineTransient:
    """Bytes per device the engine allocates for one step beyond weights and KV: a prefill, a decode step (the
    larger of its forward and its sampling) and the fp32 logits a running batch holds between steps."""

    prefill_bytes: int
    decode_bytes: int
    held_bytes: int
    prefill_positions: int
    rows: int

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + max(self.prefill_bytes, self.decode_bytes)

    def describe(self) -> str:
        mib = 1 << 20
        return (f"transient {self.peak_bytes / mib:.1f} MiB = {self.held_bytes / mib:.1f} held logits + max(prefill of "
                f"{self.prefill_positions} positions {self.prefill_bytes / mib:.1f}, decode of {self.rows} rows "
                f"{self.decode_bytes / mib:.1f})")


def position_elements(shape: ModelShape, tp: int = 1) -> int:
    """Elements one prefill position holds at once inside a layer (`a` of the module docstring)."""
    h, d = shape.hidden_size, shape.head_dim
    heads, kv, inter = math.ceil(shape.num_heads / tp), math.ceil(shape.num_kv_heads / tp), math.ceil(
        shape.intermediate_size / tp)
    attention = 4 * h + 2 * inter + (heads + 2 * kv) * d + 3 * (heads + kv) * d + (2 * heads * d if kv < heads else 0)
    mlp = 3 * h + 4 * inter
    return max(attention, mlp) + 2 * d


def engine_transient(shape: ModelShape, *, design_seq_len: int, rows: int, dtype_bytes: int,
                     max_prefill_tokens: int = ENGINE_MAX_PREFILL_TOKENS,
                     prefill_chunk_tokens: int = ENGINE_PREFILL_CHUNK_TOKENS, tp: int = 1) -> EngineTransient:
    """The engine's transient bytes per device for `rows` (>= 1) sequences of up to `design_seq_len` tokens, its
    prefills in chunks of `prefill_chunk_tokens` positions (0: whole) (the module docstring's formula)."""
    e, big_l, r, v = dtype_bytes, max(1, design_seq_len), max(1, rows), shape.vocab_size
    heads = math.ceil(shape.num_heads / tp)
    a = position_elements(shape, tp)
    positions = min(max(big_l, max_prefill_tokens) if max_prefill_tokens else r * big_l, r * big_l)
    prefill_rows = min(r, positions)
    if prefill_chunk_tokens > 0:
        positions = min(positions, max(prefill_chunk_tokens, prefill_rows))
    prefill = positions * a * e + positions * big_l * (_MASK_BYTES + e) + prefill_rows * v * (e + 8)
    forward = r * a * e + 2 * r * heads * big_l * e + r * v * (e + 4)
    decode = max(forward, _SAMPLE_BYTES * r * v)
    return EngineTransient(prefill, decode, 4 * r * v, positions, r)
