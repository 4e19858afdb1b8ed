"""Memory model of one training (or rollout) device, from a Hugging Face config and a parallel plan.

Owns: the model shape read from a config (`ModelShape.from_hf`, which refuses architectures it does
not model), the training plan (`TrainPlan`), the per-device byte prediction (`predict_train_memory`
-> `MemoryBreakdown`), the KV cache of rollout, and the fit check with "what would be needed"
(`check_fit`, `fitting_plans`, `advise`). Ranking plans by speed is `cost_model`'s job; choosing
when to reselect is the selector's.

Activations follow Korthikanti et al. 2022 (Table 2): per layer a *replicated* part (split by t only
under sequence parallelism), a *sharded* part (inside the tensor-parallel region, split by t) and
the s x s *score* part (split by t; dropped by selective recomputation and by flash attention).
Two profiles fill those parts:

* KORTHIKANTI: the paper's GPT constants (2-byte activations, 1-byte dropout masks, 4h GeLU MLP):
  replicated 10 sbh, sharded 24 sbh, scores 5 a s^2 b; full recomputation keeps 2 sbh per layer.
* HF (default): derived from what PyTorch autograd saves in a Llama/Qwen2 layer of `transformers`
  (inspected with `torch.autograd.graph.saved_tensors_hooks`), with e = activation bytes. Each
  RMSNorm saves its input in fp32, its normalised value and the output fed to the next linears:
  (4 + 2e) sbh, twice per layer (replicated). Eager attention saves q and the *repeated* k and v
  (GQA saves no activation memory there: `repeat_kv` copies before the matmul) and the o_proj
  input: 4 e s b a d; the SwiGLU MLP saves gate, silu(gate), up and their product: 4 e s b I
  (sharded). Scores: the fp32 softmax output, plus its cast copy when e < 4: (4 + e) a s^2 b.
  Flash/SDPA attention saves q, k and v at kv width, its output (which is also the o_proj input)
  and the fp32 log-sum-exp: e sb(2ad + 2kd) + 4 sba, no scores.
  The peak is not the saved total alone: it is the largest of (a) everything saved plus the loss's
  [b, s, V] fp32 buffers (`TrainPlan.logit_copies`), (b) the lm_head backward (grad of the logits
  plus the weight-gradient temporary), (c) the backward of the last layer: the other layers' saved
  tensors plus that layer's own peak (softmax backward holds probs, their grad and the scores'
  grad, 12 a s^2 b bytes; the SwiGLU backward adds 2 e s b I), (d) the optimizer step's temporaries.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from earl_stream.errors import ConfigError

GIB = 1 << 30
# [b, s, V] fp32 buffers alive at the loss's peak: HF's labels loss keeps the log-probs, their grad
# and the logits' grad (3); earl_stream's GRPO step also holds the logits and computes the entropy
# (log_softmax, exp, product) under no_grad (5).
LOGIT_COPIES_HF_CROSS_ENTROPY = 3
LOGIT_COPIES_EARL_GRPO = 5


class Recompute(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core (the s x s part) in backward
    FULL = "full"  # keep only each layer's input; recompute the layer in backward


class Attention(enum.Enum):
    EAGER = "eager"  # materialises the [b, a, s, s] scores
    FLASH = "flash"  # flash / SDPA kernels: no s x s tensor is kept


class Precision(enum.Enum):
    """(weight, gradient, optimizer-state incl. fp32 master, activation) bytes per element."""

    FP32 = "fp32"  # 4, 4, 8, 4
    MIXED_BF16 = "mixed_bf16"  # 2, 2, 12, 2 (ZeRO paper's 16 bytes/param)
    BF16 = "bf16"  # 2, 2, 4, 2 (bf16 everything, moments included)


_PRECISION_BYTES = {Precision.FP32: (4, 4, 8, 4), Precision.MIXED_BF16: (2, 2, 12, 2), Precision.BF16: (2, 2, 4, 2)}


class Profile(enum.Enum):
    HF = "hf"  # derived from transformers + PyTorch autograd (module docstring)
    KORTHIKANTI = "korthikanti"  # the paper's GPT-3 constants, verbatim


class Phase(enum.Enum):
    LOSS = "loss"
    LM_HEAD_BACKWARD = "lm_head_backward"
    LAYER_BACKWARD = "layer_backward"
    OPTIMIZER = "optimizer"


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_SUPPORTED_TYPES = frozenset({"llama", "qwen2", "mistral"})
# Fields that never change training memory (generic PretrainedConfig keys, init, rope, token ids).
_HARMLESS = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict", "transformers_version",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "hidden_act", "initializer_range", "rms_norm_eps",
    "max_position_embeddings", "use_cache", "rope_theta", "rope_scaling", "rope_parameters", "pretraining_tp",
    "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias", "max_window_layers",
    "use_sliding_window", "sliding_window", "layer_types", "attention_dropout", "is_encoder_decoder",
    "_attn_implementation_autoset", "attn_implementation", "_attn_implementation", "tokenizer_class",
    "use_return_dict", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "add_cross_attention",
})
# Fields of architectures this model does not cover (MoE, MLA, ...): named in the error when set.
_UNSUPPORTED_PREFIXES = ("num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "moe_",
                         "router_", "shared_expert", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                         "qk_nope_head_dim", "v_head_dim", "num_experts_per_tok", "decoder_sparse_step",
                         "mlp_only_layers", "topk_", "first_k_dense", "expert")
_GATED_ACTS = frozenset({"silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu"})


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense decoder-only transformer with a gated (SwiGLU) MLP."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has q/k/v biases; Llama's `attention_bias` adds o_proj's too
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, config: Any, *, ignore_fields: Iterable[str] = ()) -> ModelShape:
        """Read a `transformers.PretrainedConfig` or a config dict (config.json's keys).

        Raises ConfigError naming every missing required field, every set field of an
        unsupported architecture (MoE, MLA, sliding window, attention dropout, encoder-decoder) and
        every unknown field; pass `ignore_fields` for unknown fields known not to change memory.
        """
        d = dict(config.to_dict()) if hasattr(config, "to_dict") else dict(config)
        for k in ignore_fields:
            d.pop(k, None)
        problems = _config_problems(d)
        if problems:
            raise ConfigError("memory model cannot use this model config: " + "; ".join(problems))
        h, a = int(d["hidden_size"]), int(d["num_attention_heads"])
        kv = int(d.get("num_key_value_heads") or a)
        head_dim = int(d.get("head_dim") or h // a)
        if a % kv:
            raise ConfigError(f"num_attention_heads={a} is not a multiple of num_key_value_heads={kv}")
        bias = bool(d.get("attention_bias", False))
        return cls(hidden_size=h, num_layers=int(d["num_hidden_layers"]), num_heads=a, num_kv_heads=kv,
                   head_dim=head_dim, intermediate_size=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   qkv_bias=bias or d.get("model_type") == "qwen2", o_bias=bias, mlp_bias=bool(d.get("mlp_bias", False)))

    def layer_matrix_params(self) -> int:
        """Parameters of one layer's weight matrices (split by tensor parallelism)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size

    def layer_small_params(self) -> int:
        """Biases and norm weights of one layer (treated as replicated under tensor parallelism)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (2 * self.hidden_size + (q + 2 * kv if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)
                + (2 * self.intermediate_size + self.hidden_size if self.mlp_bias else 0))

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def num_params(self) -> int:
        return (self.num_layers * (self.layer_matrix_params() + self.layer_small_params()) + self.embedding_params()
                + self.hidden_size)


def _config_problems(d: Mapping[str, Any]) -> list[str]:
    problems = []
    missing = [k for k in _REQUIRED if d.get(k) in (None, 0)]
    if missing:
        problems.append(f"missing required fields {missing}")
    mtype = d.get("model_type")
    if mtype not in (None, "") and mtype not in _SUPPORTED_TYPES:
        problems.append(f"model_type={mtype!r} is not modelled (supported: {sorted(_SUPPORTED_TYPES)})")
    moe = sorted(k for k in d if k.startswith(_UNSUPPORTED_PREFIXES) and d[k] not in (None, 0, False, [], {}))
    if moe:
        problems.append(f"unsupported architecture (MoE/MLA) fields set: {moe}")
    unknown = sorted(k for k in d if k not in _HARMLESS and k not in _REQUIRED and not k.startswith(_UNSUPPORTED_PREFIXES))
    if unknown:
        problems.append(f"unknown fields {unknown} (pass ignore_fields=... if they do not change memory)")
    types = set(d.get("layer_types") or ["full_attention"])
    if d.get("sliding_window") and (d.get("use_sliding_window", "use_sliding_window" not in d) or types - {"full_attention"}):
        problems.append(f"sliding_window={d['sliding_window']} is set: sliding-window attention is not modelled")
    elif types - {"full_attention"}:
        problems.append(f"layer_types {sorted(types)}: only full attention is modelled")
    if float(d.get("attention_dropout") or 0.0) > 0:
        problems.append(f"attention_dropout={d['attention_dropout']}: dropout masks are not modelled")
    if d.get("is_encoder_decoder") or d.get("add_cross_attention"):
        problems.append("encoder-decoder / cross-attention models are not modelled")
    if d.get("hidden_act", "silu") not in _GATED_ACTS:
        problems.append(f"hidden_act={d.get('hidden_act')!r} is not modelled (supported: {sorted(_GATED_ACTS)})")
    return problems


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """How one training micro-batch runs. Devices = dp * tp * sp.

    sp is Ulysses-style sequence parallelism (tokens split outside attention, heads inside); with
    fsdp the states are sharded over dp * sp (as FSDP over the whole non-tensor-parallel group).
    `sequence_parallel` is Megatron's SP inside the tensor-parallel group (splits the replicated
    region by tp). `shard_logits`: vocab-parallel lm_head and loss (logits split by tp).
    """

    micro_batch: int
    seq_len: int
    dp: int = 1
    tp: int = 1
    sp: int = 1
    sequence_parallel: bool = False
    fsdp: bool = False
    recompute: Recompute = Recompute.NONE
    attention: Attention = Attention.FLASH
    precision: Precision = Precision.FP32
    logit_copies: int = LOGIT_COPIES_HF_CROSS_ENTROPY
    shard_logits: bool = True
    foreach_optimizer: bool = False  # torch's foreach AdamW (CUDA default) holds one fp32 copy of the states

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.sp

    def describe(self) -> str:
        return (f"dp={self.dp} tp={self.tp}{'+sp' if self.sequence_parallel else ''} sp={self.sp} "
                f"fsdp={self.fsdp} recompute={self.recompute.value} attention={self.attention.value} "
                f"micro_batch={self.micro_batch} seq_len={self.seq_len}")


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one device at the step's peak. activations/logits/transient are those alive then."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    transient_bytes: int
    peak_phase: Phase

    @property
    def static_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def dynamic_bytes(self) -> int:
        """What one step adds on top of the allocated states (what bench/memory_model.py measures)."""
        return self.activations_bytes + self.logits_bytes + self.transient_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.dynamic_bytes


@dataclasses.dataclass(frozen=True)
class _Layer:
    """Bytes per layer on one device: saved at the end of forward, and the layer's own backward peak."""

    replicated: float
    sharded: float
    scores: float
    input: float  # what full recomputation keeps
    backward_peak: float  # this layer's saved tensors still alive + its in-flight grads, at its worst
    residual_grad: float

    @property
    def saved(self) -> float:
        return self.replicated + self.sharded + self.scores


def _check_plan(shape: ModelShape, plan: TrainPlan) -> None:
    bad = [f"{k}={getattr(plan, k)}" for k in ("micro_batch", "seq_len", "dp", "tp", "sp", "logit_copies")
           if getattr(plan, k) < 1]
    if shape.num_heads % (plan.tp * plan.sp):
        bad.append(f"tp*sp={plan.tp * plan.sp} does not divide num_heads={shape.num_heads}")
    if plan.seq_len % plan.sp:
        bad.append(f"sp={plan.sp} does not divide seq_len={plan.seq_len}")
    if bad:
        raise ConfigError("invalid training plan: " + "; ".join(bad))


def layer_activation_bytes(shape: ModelShape, plan: TrainPlan, profile: Profile = Profile.HF) -> _Layer:
    """Per-layer activation bytes of one micro-batch on one device (see the module docstring)."""
    _check_plan(shape, plan)
    b, s, t, p = plan.micro_batch, plan.seq_len, plan.tp, plan.sp
    h, a, d, kv, inter = shape.hidden_size, shape.num_heads, shape.head_dim, shape.num_kv_heads, shape.intermediate_size
    n = b * s / p  # tokens on this device outside attention
    rep_div = t if plan.sequence_parallel else 1
    score_el = b * (a / (t * p)) * s * s
    keep_scores = plan.attention is Attention.EAGER and plan.recompute is Recompute.NONE
    if profile is Profile.KORTHIKANTI:
        rep, shd, sc = 10 * n * h / rep_div, 24 * n * h / t, 5 * score_el
        lay = _Layer(rep, shd, sc if keep_scores else 0.0, 2 * n * h / rep_div, rep + shd + sc, 0.0)
        return lay
    e = _PRECISION_BYTES[plan.precision][3]
    gbytes = _PRECISION_BYTES[plan.precision][1]
    kv_width = max(kv / t, 1.0) * d
    q_el, kv_el, m_el = n * a * d / t, n * kv_width, n * inter / t
    norm = n * h / rep_div * (4 + 2 * e)  # one RMSNorm: fp32 input, normalised, output
    if plan.attention is Attention.EAGER:
        attn = 4 * q_el * e  # q, repeated k and v, o_proj input
        attn_peak = norm + 2 * q_el * e + 12 * score_el + q_el * e  # softmax backward: probs + 2 grads (fp32), grad v
    else:
        attn = (2 * q_el + 2 * kv_el) * e + 4 * n * a / t
        attn_peak = norm + attn + 4 * q_el * e  # grads of O, q, k, v (k, v at full width, to be safe)
    mlp = 4 * m_el * e
    scores = score_el * (4 + (e if e < 4 else 0))
    saved_scores = scores if keep_scores else 0.0
    full = 2 * norm + attn + mlp + saved_scores
    dx = n * h / rep_div * e
    mlp_peak = full + 2 * m_el * e  # at silu*up backward: grad of the product, of silu and of up
    down_peak = full + m_el * e + h * inter / t * gbytes  # down_proj backward: grad input + weight-grad temp
    peak = max(mlp_peak, down_peak, attn_peak) + dx
    return _Layer(2 * norm, attn + mlp, saved_scores, n * h / rep_div * e, peak, dx)


def _static_bytes(shape: ModelShape, plan: TrainPlan) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer states, params) on one device."""
    t = plan.tp
    params = (shape.num_layers * (shape.layer_matrix_params() / t + shape.layer_small_params())
              + shape.embedding_params() / t + shape.hidden_size)
    if plan.fsdp:
        params /= plan.dp * plan.sp
    w, g, o, _ = _PRECISION_BYTES[plan.precision]
    return params * w, params * g, params * o, params


def predict_train_memory(shape: ModelShape, plan: TrainPlan, profile: Profile = Profile.HF) -> MemoryBreakdown:
    """Peak bytes on one device for one micro-batch step (forward, backward, optimizer step).

    HF profile: the largest of the four phases in the module docstring. KORTHIKANTI profile: the
    paper's accounting (all saved activations + logits, no transients; full recomputation adds
    one recomputed layer).
    """
    lay = layer_activation_bytes(shape, plan, profile)
    weights, grads, opt, params = _static_bytes(shape, plan)
    L, t, n = shape.num_layers, plan.tp, plan.micro_batch * plan.seq_len / plan.sp
    e = _PRECISION_BYTES[plan.precision][3]
    full = plan.recompute is Recompute.FULL
    kept = L * lay.input if full else L * lay.saved
    vocab = shape.vocab_size / (t if plan.shard_logits else 1)
    logit = n * vocab * 4
    head_norm = lay.replicated / 2
    fsdp_buf = 0.0
    if plan.fsdp:  # the unsharded weights of the current and the prefetched layer, one layer's full grads
        layer_p = shape.layer_matrix_params() / t + shape.layer_small_params()
        fsdp_buf = layer_p * (2 * _PRECISION_BYTES[plan.precision][0] + _PRECISION_BYTES[plan.precision][1])
    if profile is Profile.KORTHIKANTI:
        acts = kept + (lay.backward_peak if full else 0.0) + 2 * n * shape.hidden_size / (t if plan.sequence_parallel else 1)
        return _breakdown(weights, grads, opt, acts, plan.logit_copies * logit, fsdp_buf, Phase.LOSS)
    extra_logits = n * vocab * e if e < 4 else 0.0  # the lm_head output before the fp32 upcast
    ckpt_mask = plan.micro_batch * plan.seq_len ** 2 * 4 / plan.sp if full and plan.attention is Attention.EAGER else 0.0
    grad_bytes = _PRECISION_BYTES[plan.precision][1]
    lm_w_grad = shape.vocab_size * shape.hidden_size / t * grad_bytes
    phases = [
        (Phase.LOSS, kept + head_norm, plan.logit_copies * logit + extra_logits, ckpt_mask),
        (Phase.LM_HEAD_BACKWARD, kept + head_norm, logit, lay.residual_grad + lm_w_grad + ckpt_mask),
        (Phase.LAYER_BACKWARD, (L - 1) * (lay.input if full else lay.saved), 0.0, lay.backward_peak + ckpt_mask),
    ]
    biggest = max(shape.vocab_size * shape.hidden_size / t, shape.intermediate_size * shape.hidden_size / t)
    fp32_temp = params * 4 if plan.foreach_optimizer else 2 * biggest * 4
    phases.append((Phase.OPTIMIZER, 0.0, 0.0, fp32_temp))
    phase, acts, logits, transient = max(phases, key=lambda ph: ph[1] + ph[2] + ph[3])
    if phase is not Phase.OPTIMIZER:
        transient += fsdp_buf
    return _breakdown(weights, grads, opt, acts, logits, transient, phase)


def _breakdown(w: float, g: float, o: float, acts: float, logits: float, transient: float, phase: Phase) -> MemoryBreakdown:
    return MemoryBreakdown(weights_bytes=math.ceil(w), gradients_bytes=math.ceil(g), optimizer_bytes=math.ceil(o),
                           activations_bytes=math.ceil(acts), logits_bytes=math.ceil(logits),
                           transient_bytes=math.ceil(transient), peak_phase=phase)


def kv_cache_bytes_per_token(shape: ModelShape, *, dtype_bytes: int = 2, tp: int = 1) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes; kv heads are split by tp (replicated past it)."""
    kv_per_device = math.ceil(shape.num_kv_heads / tp)
    return 2 * shape.num_layers * kv_per_device * shape.head_dim * dtype_bytes


def predict_kv_cache_bytes(shape: ModelShape, tokens: int, *, dtype_bytes: int = 2, tp: int = 1) -> int:
    """KV cache bytes on one device for `tokens` cached tokens (all sequences of an engine together)."""
    return tokens * kv_cache_bytes_per_token(shape, dtype_bytes=dtype_bytes, tp=tp)


def predict_rollout_bytes(shape: ModelShape, tokens: int, *, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Weights of an inference engine (split by tp) plus its KV cache for `tokens` tokens."""
    weights = (shape.num_layers * (shape.layer_matrix_params() / tp + shape.layer_small_params())
               + shape.embedding_params() / tp + shape.hidden_size) * dtype_bytes
    return math.ceil(weights) + predict_kv_cache_bytes(shape, tokens, dtype_bytes=dtype_bytes, tp=tp)


# ----------------------------------------------------------------------------------- fitting


@dataclasses.dataclass(frozen=True)
class FitAdvice:
    """Whether a plan fits a per-device budget, the plans that do, and what would be needed."""

    fits: bool
    plan: TrainPlan
    breakdown: MemoryBreakdown
    budget_bytes: int
    alternatives: tuple[TrainPlan, ...]  # plans on the same devices that fit, least recomputation first
    min_devices: int | None  # fewest devices (up to the search limit) on which some plan fits
    min_budget_bytes: int  # smallest per-device budget at which some plan on these devices fits
    message: str


def check_fit(shape: ModelShape, plan: TrainPlan, budget_bytes: int, *, reserve_bytes: int = 0,
              profile: Profile = Profile.HF) -> tuple[bool, MemoryBreakdown]:
    """(fits, breakdown): total + reserve (runtime, allocator slack) <= budget."""
    bd = predict_train_memory(shape, plan, profile)
    return bd.total_bytes + reserve_bytes <= budget_bytes, bd


def _divisors_pow2(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit and limit % (1 << i) == 0]


def fitting_plans(shape: ModelShape, base: TrainPlan, devices: int, budget_bytes: int, *, reserve_bytes: int = 0,
                  recomputes: Sequence[Recompute] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL),
                  allow_tp: bool = True, allow_sp: bool = True, profile: Profile = Profile.HF,
                  ) -> list[tuple[TrainPlan, MemoryBreakdown]]:
    """Every variant of `base` on exactly `devices` devices (tp, sp, fsdp, recompute) that fits."""
    out = []
    for tp in _divisors_pow2(devices) if allow_tp else [1]:
        for sp in _divisors_pow2(devices // tp) if allow_sp else [1]:
            if shape.num_heads % (tp * sp) or base.seq_len % sp:
                continue
            for fsdp in (False, True):
                for rc in recomputes:
                    plan = dataclasses.replace(base, tp=tp, sp=sp, dp=devices // (tp * sp), fsdp=fsdp, recompute=rc,
                                               sequence_parallel=base.sequence_parallel and tp > 1)
                    ok, bd = check_fit(shape, plan, budget_bytes, reserve_bytes=reserve_bytes, profile=profile)
                    if ok:
                        out.append((plan, bd))
    rank = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}
    out.sort(key=lambda pb: (rank[pb[0].recompute], pb[0].tp * pb[0].sp, pb[0].fsdp, pb[1].total_bytes))
    return out


def advise(shape: ModelShape, plan: TrainPlan, budget_bytes: int, *, reserve_bytes: int = 0,
           recomputes: Sequence[Recompute] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL),
           max_devices: int = 4096, profile: Profile = Profile.HF) -> FitAdvice:
    """Check `plan`; if it does not fit, say which plans on its devices do, or what would be needed."""
    ok, bd = check_fit(shape, plan, budget_bytes, reserve_bytes=reserve_bytes, profile=profile)
    kw: dict[str, Any] = dict(reserve_bytes=reserve_bytes, recomputes=recomputes, profile=profile)
    alts = fitting_plans(shape, plan, plan.devices, budget_bytes, **kw)
    everything = fitting_plans(shape, plan, plan.devices, 1 << 62, **kw)
    min_budget = min((b.total_bytes for _, b in everything), default=bd.total_bytes) + reserve_bytes
    min_dev = plan.devices if alts else None
    devices = plan.devices * 2
    while min_dev is None and devices <= max_devices:
        if fitting_plans(shape, plan, devices, budget_bytes, **kw):
            min_dev = devices
        devices *= 2
    need = f"{bd.total_bytes / GIB:.2f} GiB ({bd.peak_phase.value} peak) vs a budget of {budget_bytes / GIB:.2f} GiB"
    if ok:
        msg = f"fits: {plan.describe()} needs {need}"
    elif alts:
        msg = f"does not fit: {plan.describe()} needs {need}; fits instead with {alts[0][0].describe()}"
    else:
        more = (f"needs >= {min_dev} devices (e.g. {fitting_plans(shape, plan, min_dev, budget_bytes, **kw)[0][0].describe()})"
                if min_dev else f"no plan fits on up to {max_devices} devices")
        msg = (f"nothing fits on {plan.devices} device(s) with {budget_bytes / GIB:.2f} GiB each: {more}, "
               f"or a per-device budget of >= {min_budget / GIB:.2f} GiB")
    return FitAdvice(fits=ok, plan=plan, breakdown=bd, budget_bytes=budget_bytes,
                     alternatives=tuple(p for p, _ in alts), min_devices=min_dev, min_budget_bytes=min_budget,
                     message=msg)
