"""Memory model of one training (or rollout) device, from a Hugging Face config and a parallel plan.

Owns: the training plan (`TrainPlan`), the per-device prediction (`predict_train_memory` ->
`MemoryBreakdown`) and the rollout KV cache. Which plans fit a budget, and what would be needed when none
does, is `fitting`'s.
The model's shape comes from `model_shape.ModelShape.from_hf` (read from the model built on the meta
device: parameters, gradients and optimizer states are counted from its exact tensors); ranking plans
by speed is `cost_model`'s job; deciding when to reselect is the selector's.

Activations follow Korthikanti et al. 2022 (Table 2): per layer a *replicated* part (split by t only
under sequence parallelism), a *sharded* part (inside the tensor-parallel region, split by t) and
the s x s *score* part (split by t; dropped by selective recomputation and by flash attention).
`korthikanti_layer_bytes` is Table 2 verbatim (GPT: 2-byte activations, 1-byte dropout masks, 4h
GeLU MLP: 10 sbh replicated, 24 sbh sharded, 5 a s^2 b scores; full recomputation keeps 2 sbh).
`predict_train_memory` adapts the constants to Llama/Qwen2 layers as `transformers` runs them,
from what PyTorch autograd saves (inspected with `torch.autograd.graph.saved_tensors_hooks`), with
e = activation bytes. Each RMSNorm saves its input in fp32, its normalised value and the output fed
to the next linears: (4 + 2e) sbh, twice per layer (replicated). Eager attention saves q and the
*repeated* k and v (GQA saves no activation memory there: `repeat_kv` copies before the matmul) and
the o_proj input: 4 e s b a d; the SwiGLU MLP saves gate, silu(gate), up and their product:
4 e s b I (sharded). Scores: the fp32 softmax output, plus its cast copy when e < 4: (4 + e) a s^2 b.
Flash/SDPA attention saves q, k and v at kv width, its output and the fp32 log-sum-exp, and the o_proj its
input, which the trainer's packed attention concatenates from the rows' outputs (a copy): e sb(3ad + 2kd) + 4 sba,
no scores. Families differ by data on the shape: a norm on a
sub-layer's output (Gemma 3, OLMo 2: `post_norms`) saves (4 + e) sbh, its output feeding an add; q/k
norms (Qwen3, Gemma 3, OLMo 2) save their fp32 input and normalised value, (4 + e) per q and k element;
a sub-layer with no norm before it (OLMo 2) has its linears save the residual stream, e sbh. A routed-expert
layer also saves each token's top_k gathered rows and its experts' outputs: 2 e s b k h. A vision-language
model's tower saves its activations for the image tokens among them (`vision_activation_bytes`).
Under autocast over fp32 weights (`Precision.AUTOCAST_BF16` without FSDP, whose mixed-precision policy gathers
bf16 weights and so runs a bf16 stream) the residual stream, the embedding and the norms stay fp32: each RMSNorm
saves its fp32 input and normalised value and each linear after it its own bf16 cast, (8 + c e) sbh for c linears
(q, k, v: 3; gate, up: 2), the residual gradient is fp32, and the logits are the LM head's bf16 output (earl_stream's
fp32 logits buffer is then a transient upcast). Under FSDP2 the root's unsharded weights (embedding, final norm,
LM head) stay gathered from its forward to the end of the backward. Both measured.
The peak is not the saved total alone but the largest of: (a) everything saved plus the loss's
[b, s, V] fp32 buffers (`TrainPlan.logit_copies`); (b) the lm_head backward (the logits' grad and
the weight-gradient temporary); (c) the last layer's backward: the other layers' saved tensors plus
that layer's own peak (softmax backward holds the probs, their grad and the scores' grad, 12 a s^2 b
bytes; the SwiGLU backward adds 2 e s b I; a tied embedding's lm_head weight gradient waits in
autograd's input buffer meanwhile); (d) the optimizer step's temporaries.
Expert parallel (`TrainPlan.ep`, mixture-of-experts models): each device holds E/ep of every MoE
layer's experts (weights, gradients, optimizer state; FSDP does not shard them further, nor gather
them per layer) and, while a layer runs, its dispatch buffers: the N x top_k hidden rows sent, those
received, the experts' outputs and those coming back (4 e N k h bytes; the received count is the
average, a router that sends every token to one rank's experts holds more).
Not modelled (keep a reserve for them): communication buffers (TP all-reduce, Ulysses all-to-all,
DDP buckets), the runtime itself, and allocator slack. On CPU, glibc keeps freed blocks unless
MALLOC_MMAP_THRESHOLD_ is fixed (e.g. 65536); bench/memory_model.py measures how far RSS rises without it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

from earl_stream.errors import ConfigError
from earl_stream.supervisor.model_shape import ModelShape
from earl_stream.supervisor.param_tensors import parameter_tensors, published_share_bytes, rank_share

GIB = 1 << 30
# [b, s, V] fp32 buffers alive at the loss's peak: HF's labels loss keeps the log-probs, their grad
# and the logits' grad (3); earl_stream's GRPO step also holds the logits and computes the entropy
# (log_softmax, exp, product) under no_grad (5).
LOGIT_COPIES_HF_CROSS_ENTROPY = 3
LOGIT_COPIES_EARL_GRPO = 5
# `workers.train_step` computes log-probs and entropy with `workers.vocab_parallel` on every plan
# (tp = 1 included): the logits, their max-shifted copy (gather's backward saves its input), its exp
# (exp's backward saves its output), and the entropy's shifted copy, exp and product under no_grad
# (6). Measured per rank under dp1/fsdp2/tp2/sp2/fsdp2_tp2 by bench/memory_model.py part (c).
LOGIT_COPIES_EARL_VOCAB_PARALLEL = 6


class Recompute(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core (the s x s part) in backward
    FULL = "full"  # keep only each layer's input; recompute the layer in backward


class Attention(enum.Enum):
    EAGER, FLASH = "eager", "flash"  # eager materialises the [b, a, s, s] scores; flash/SDPA keeps none


class Precision(enum.Enum):
    """(weight, gradient, optimizer-state incl. fp32 master, activation) bytes per element."""

    FP32 = "fp32"  # 4, 4, 8, 4
    MIXED_BF16 = "mixed_bf16"  # 2, 2, 12, 2 (ZeRO paper's 16 bytes/param)
    BF16 = "bf16"  # 2, 2, 4, 2 (bf16 everything, moments included)
    # what earl_stream's trainer runs for trainer.dtype=bf16: fp32 parameters and gradients, bf16 compute
    # under torch.autocast, whose bf16 copy of every weight is kept for the backward pass (4 + 2 bytes);
    # under FSDP2 that copy is its per-layer bf16 all-gather instead, so this over-counts there (safe side)
    AUTOCAST_BF16 = "autocast_bf16"  # 6, 4, 8, 2

    @property
    def element_bytes(self) -> tuple[int, int, int, int]:
        return _PRECISION_BYTES[self]


_PRECISION_BYTES = {Precision.FP32: (4, 4, 8, 4), Precision.MIXED_BF16: (2, 2, 12, 2), Precision.BF16: (2, 2, 4, 2),
                    Precision.AUTOCAST_BF16: (6, 4, 8, 2)}


class Phase(enum.Enum):
    LOSS, LM_HEAD_BACKWARD, LAYER_BACKWARD, OPTIMIZER = "loss", "lm_head_backward", "layer_backward", "optimizer"


@dataclasses.dataclass(frozen=True)
class TrainPlan:
    """How one training micro-batch runs. Devices = dp * tp * sp.

    `ep`: expert parallel degree (mixture-of-experts models; divides dp: ep ranks are data ranks),
    experts sharded ep-way; with fsdp the rest of the model is sharded over dp * sp as without ep.

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
    lora_params: int = 0  # LoRA (model.lora): adapter parameters of the whole model, the base frozen; 0 = full
    ep: int = 1
    # policy versions of its weights a rank holds in its shard node for the rollout pool during a step (the
    # trainer keeps two; a third exists only while it publishes, after the step's activations are gone); 0 =
    # none counted (a bare training step)
    published_versions: int = 0
    # a vision-language model's micro-batches: the share of their tokens that are image tokens (observed by the
    # supervisor from the samples' images), and whether the tower is frozen (model.freeze_vision: it saves nothing)
    image_share: float = 0.0
    vision_frozen: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.sp

    def describe(self) -> str:
        megatron_sp = " (sequence parallel)" if self.sequence_parallel else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"dp={self.dp} tp={self.tp}{megatron_sp} sp={self.sp}{ep} fsdp={self.fsdp} "
                f"recompute={self.recompute.value} attention={self.attention.value} "
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
    published_bytes: int = 0  # the policy versions this rank holds for the rollout pool (its shard node)

    @property
    def static_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def dynamic_bytes(self) -> int:
        """What one step adds on top of the allocated states (what bench/memory_model.py measures)."""
        return self.activations_bytes + self.logits_bytes + self.transient_bytes

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.dynamic_bytes + self.published_bytes


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """One layer of one micro-batch on one device: bytes saved for backward, and its backward peak."""

    replicated_bytes: float  # norms' tensors (split by tp only under sequence parallelism)
    sharded_bytes: float  # attention projections and MLP (split by tp)
    scores_bytes: float  # the s x s scores kept for backward (0 with flash or recomputation)
    input_bytes: float  # what full recomputation keeps
    backward_peak_bytes: float  # this layer's tensors still alive + its in-flight grads, at its worst
    residual_grad_bytes: float

    @property
    def saved_bytes(self) -> float:
        return self.replicated_bytes + self.sharded_bytes + self.scores_bytes


def _check_plan(shape: ModelShape, plan: TrainPlan) -> None:
    bad = [f"{k}={getattr(plan, k)}" for k in ("micro_batch", "seq_len", "dp", "tp", "sp", "logit_copies", "ep")
           if getattr(plan, k) < 1]
    if plan.ep > 1 and (plan.dp % plan.ep or not shape.is_moe or shape.num_experts % plan.ep or plan.tp * plan.sp > 1):
        bad.append(f"ep={plan.ep} needs a mixture-of-experts model whose {shape.num_experts} experts it divides, "
                   f"dp={plan.dp} it divides, and tp = sp = 1")
    if not 0.0 <= plan.image_share <= 1.0:
        bad.append(f"image_share={plan.image_share} (a share of the tokens: within [0, 1])")
    if shape.num_heads % (plan.tp * plan.sp):
        bad.append(f"tp*sp={plan.tp * plan.sp} does not divide num_heads={shape.num_heads}")
    if plan.seq_len % plan.sp:
        bad.append(f"sp={plan.sp} does not divide seq_len={plan.seq_len}")
    if bad:
        raise ConfigError("invalid training plan: " + "; ".join(bad))


def korthikanti_layer_bytes(shape: ModelShape, plan: TrainPlan) -> float:
    """Table 2 of Korthikanti et al. 2022: activation bytes per layer, (b, s, h, a, t) of the plan.

    sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with tensor parallelism;
    sbh/t (34 + 5as/h) with tensor + sequence parallelism; selective recomputation (and flash
    attention, which keeps no s x s tensor either) drops the 5as/h term; full recomputation: 2sbh.
    Ulysses sp divides everything (tokens outside attention, heads inside).
    """
    _check_plan(shape, plan)
    sbh = plan.micro_batch * plan.seq_len * shape.hidden_size / plan.sp
    t, rep_div = plan.tp, (plan.tp if plan.sequence_parallel else 1)
    if plan.recompute is Recompute.FULL:
        return 2 * sbh / rep_div
    keep_scores = plan.attention is Attention.EAGER and plan.recompute is Recompute.NONE
    scores = 5 * shape.num_heads * plan.seq_len / shape.hidden_size if keep_scores else 0.0
    return sbh * (10 / rep_div + 24 / t + scores / t)


def layer_activation_bytes(shape: ModelShape, plan: TrainPlan) -> LayerActivations:
    """Per-layer activation bytes of one micro-batch on one device (see the module docstring)."""
    _check_plan(shape, plan)
    b, s, t, p = plan.micro_batch, plan.seq_len, plan.tp, plan.sp
    h, a, d, inter = shape.hidden_size, shape.num_heads, shape.head_dim, shape.intermediate_size
    n = b * s / p  # tokens on this device outside attention
    rep_div = t if plan.sequence_parallel else 1
    score_el = b * (a / (t * p)) * s * s
    keep_scores = plan.attention is Attention.EAGER and plan.recompute is Recompute.NONE
    _, gbytes, _, e = plan.precision.element_bytes
    q_el, kv_el, m_el = n * a * d / t, n * max(shape.num_kv_heads / t, 1.0) * d, n * inter / t
    norm = mlp_norm = n * h / rep_div * (4 + 2 * e)  # one RMSNorm: fp32 input, normalised, output
    if _fp32_stream(plan):  # fp32 input and normalised value, then each linear after it saves its own bf16 cast
        norm = n * h / rep_div * (8 + (1 if shape.fused_qkv else 3) * e)
        mlp_norm = n * h / rep_div * (8 + (1 if shape.fused_gate_up else 2) * e)
    # a sub-layer without a norm before it (OLMo 2) has its linears save the residual stream itself
    norms = (shape.pre_norms * (norm + mlp_norm) / 2 + shape.post_norms * n * h / rep_div * (4 + e)
             + max(0, 2 - shape.pre_norms) * n * h / rep_div * e)
    qk_norm = (q_el + n * shape.num_kv_heads * d / t) * (4 + e) if shape.qk_norm else 0.0
    if plan.attention is Attention.EAGER:
        attn = 4 * q_el * e + qk_norm  # q, repeated k and v, o_proj input
        # softmax backward: fp32 probs, their grad and the scores' grad; q, k and grad v alive
        attn_peak = norm + 3 * q_el * e + 12 * score_el
    else:
        # + the o_proj input: the trainer's packed attention (workers.packed_attention) concatenates the rows'
        # outputs, a copy beside the output SDPA saves (flash_attn's varlen kernel on CUDA needs none: safe side)
        attn = (3 * q_el + 2 * kv_el) * e + 4 * n * a / t + qk_norm
        attn_peak = norm + attn + 4 * q_el * e  # grads of O, q, k, v (k, v at full width, to be safe)
    mlp = 4 * m_el * e
    if shape.is_moe:  # each routed row gathered for its expert, and the expert's output the routing weight scales
        mlp += 2 * n * shape.top_k * h * e * shape.moe_layers / shape.num_layers
    scores = score_el * (4 + (e if e < 4 else 0))
    saved_scores = scores if keep_scores else 0.0
    # The layer being back-propagated holds its scores again under full recomputation; selective
    # recomputation rebuilds them only for the attention backward (counted in attn_peak).
    own_scores = 0.0 if plan.attention is Attention.FLASH or plan.recompute is Recompute.SELECTIVE else scores
    full = norms + attn + mlp + own_scores
    dx = n * h / rep_div * _stream_bytes(plan)  # the residual stream's gradient (and a layer's input)
    mlp_peak = full + 2 * m_el * e  # at silu*up backward: grad of the product, of silu and of up
    down_peak = full + m_el * e + h * inter / t * gbytes  # down_proj backward: grad input + weight-grad temp
    peak = max(mlp_peak, down_peak, attn_peak) + dx
    return LayerActivations(norms, attn + mlp, saved_scores, dx, peak, dx)


def _fp32_stream(plan: TrainPlan) -> bool:
    """Autocast over fp32 weights (trainer.dtype=bf16 without FSDP, whose mixed-precision policy gathers bf16
    weights instead) keeps the residual stream, the embedding's output and the norms in fp32; only the
    linears', attention's and the LM head's outputs are bf16 (measured with saved-tensor hooks)."""
    return plan.precision is Precision.AUTOCAST_BF16 and not plan.fsdp


def _stream_bytes(plan: TrainPlan) -> int:
    """Bytes per element of the residual stream (a layer's input, its gradient)."""
    return 4 if _fp32_stream(plan) else plan.precision.element_bytes[3]


def _largest_image_tokens(shape: ModelShape, plan: TrainPlan) -> float:
    """Image tokens of the largest image a row can hold: a tile (Idefics3 tiles every image), or for Qwen2-VL,
    whose images come in any size, every image token of the row."""
    tower = shape.vision
    assert tower is not None
    return float(tower.tile_tokens) if tower.family == "idefics3" else plan.image_share * plan.seq_len


def vision_tokens_per_device(shape: ModelShape, plan: TrainPlan) -> float:
    """Image tokens one device runs the vision tower over in a micro-batch: `plan.image_share` of its tokens (every
    tp rank runs the tower on the same ones), and under sequence parallelism two more images (a rank runs the tower
    over every image its slice cuts, whole; an Idefics3 image is cut by tiles, a Qwen2-VL one whole)."""
    tower = shape.vision
    if tower is None or plan.image_share <= 0:
        return 0.0
    tokens = plan.image_share * plan.micro_batch * plan.seq_len
    return min(tokens, tokens / plan.sp + 2 * _largest_image_tokens(shape, plan)) if plan.sp > 1 else tokens


def vision_activation_bytes(shape: ModelShape, plan: TrainPlan) -> float:
    """What a vision-language model's tower saves for the backward on one device (`model_shape.VisionTower`),
    alive from the forward's start to the end of the backward: the image tokens of the device's tokens
    (`plan.image_share` of them), and under sequence parallelism two more images (`vision_tokens_per_device`).
    0 for a frozen tower (nothing it computes needs a gradient) or a text-only model."""
    tower = shape.vision
    if tower is None or plan.vision_frozen or plan.image_share <= 0:
        return 0.0
    tokens = vision_tokens_per_device(shape, plan)
    e = plan.precision.element_bytes[3]
    return tokens * tower.saved_bytes_per_token(e, eager=plan.attention is Attention.EAGER,
                                                full_recompute=plan.recompute is Recompute.FULL,
                                                image_patches=tower.patches_per_token * _largest_image_tokens(shape, plan))


@functools.cache  # a function of the shape and tp alone; the selector asks it for every plan it weighs
def _device_params(shape: ModelShape, tp: int) -> float:
    """Parameters on one device of a tensor-parallel group (norms and biases replicated): the model's
    exact tensors (`param_tensors.parameter_tensors`), each as tp splits it."""
    return float(sum(rank_share(t, tp=tp, fsdp_shards=0, ep=1)[0] for t in parameter_tensors(shape)))


@functools.cache
def expert_params(shape: ModelShape) -> int:
    """Parameters of every routed expert of the model (gate, up and down of each; routers excluded)."""
    return sum(t.numel for t in parameter_tensors(shape) if t.expert)


def predict_train_memory(shape: ModelShape, plan: TrainPlan) -> MemoryBreakdown:
    """Peak bytes on one device for one micro-batch step (forward, backward, optimizer step): the
    largest of the four phases in the module docstring, on top of weights, grads and optimizer states.
    """
    lay = layer_activation_bytes(shape, plan)
    shards = plan.dp * plan.sp if plan.fsdp else 1
    experts = expert_params(shape) if plan.ep > 1 else 0  # ep: E/ep experts per device, outside FSDP
    params = (_device_params(shape, plan.tp) - experts) / shards + experts / plan.ep
    w_bytes, grad_bytes, opt_bytes, e = plan.precision.element_bytes
    # LoRA: the frozen base has weights only; the adapters have weights, gradients and AdamW state
    trained = plan.lora_params / shards if plan.lora_params else params
    weights, grads, opt = (params + (trained if plan.lora_params else 0)) * w_bytes, trained * grad_bytes, \
        trained * opt_bytes
    L, t, n = shape.num_layers, plan.tp, plan.micro_batch * plan.seq_len / plan.sp
    full = plan.recompute is Recompute.FULL
    tower = vision_activation_bytes(shape, plan)
    kept = (L * lay.input_bytes if full else L * lay.saved_bytes) + tower
    vocab = shape.vocab_size / (t if plan.shard_logits else 1)
    logit = n * vocab * 4
    # the final norm, as one pre-norm (under an fp32 stream: fp32 input, normalised, the LM head's bf16 cast)
    head_norm = lay.input_bytes * ((8 + e) / 4 if _fp32_stream(plan) else (4 + 2 * e) / e)
    fsdp_buf = 0.0
    if plan.fsdp:  # the unsharded weights of the current and the prefetched layer, one layer's full grads
        layer_p = shape.layer_matrix_params() / t + shape.layer_small_params() - experts / shape.num_layers
        layer_grads = plan.lora_params / shape.num_layers if plan.lora_params else layer_p
        # gathered as the trainer's mixed-precision policy casts them (bf16 under autocast); FSDP2 keeps the root's
        # unsharded weights (embedding, final norm, LM head) from its forward to the end of the backward
        gathered = 2 if plan.precision is Precision.AUTOCAST_BF16 else w_bytes
        root_p = max(0.0, _device_params(shape, t) - L * (shape.layer_matrix_params() / t + shape.layer_small_params()))
        fsdp_buf = (layer_p * 2 + root_p) * gathered + layer_grads * grad_bytes
    # With e < 4 the logits are the LM head's bf16 output; earl_stream's counts hold the logits as one of their
    # fp32 buffers, which is then only an upcast freed once shifted (HF's count does not hold the logits).
    loss_logits = plan.logit_copies * logit
    if e < 4:
        loss_logits += n * vocab * e - (logit if plan.logit_copies != LOGIT_COPIES_HF_CROSS_ENTROPY else 0.0)
    # HF's eager [b, 1, s, s] fp32 mask is an argument of every checkpointed layer: it lives on.
    eager = plan.attention is Attention.EAGER
    ckpt_mask = plan.micro_batch * plan.seq_len ** 2 * 4 / plan.sp if full and eager else 0.0
    lm_w_grad = 0.0 if plan.lora_params else shape.vocab_size * shape.hidden_size / t * grad_bytes  # frozen head
    # A tied embedding's lm_head gradient waits in the autograd engine's input buffer until the
    # embedding's own contribution arrives at the very end of the backward.
    tied_wait = lm_w_grad if shape.tie_word_embeddings else 0.0
    biggest = min(max(shape.vocab_size, shape.intermediate_size) * shape.hidden_size / t, trained)
    dispatch = 4 * e * n * shape.top_k * shape.hidden_size if plan.ep > 1 else 0.0  # one MoE layer's rows in flight
    phases = [
        (Phase.LOSS, kept + head_norm, loss_logits, ckpt_mask + fsdp_buf),
        (Phase.LM_HEAD_BACKWARD, kept + head_norm, logit,
         lay.residual_grad_bytes + lm_w_grad + ckpt_mask + fsdp_buf),
        (Phase.LAYER_BACKWARD, (L - 1) * (lay.input_bytes if full else lay.saved_bytes) + tower, 0.0,
         lay.backward_peak_bytes + ckpt_mask + tied_wait + fsdp_buf + dispatch),
        # single-tensor AdamW: sqrt and division temporaries of the biggest tensor (fp32 master)
        (Phase.OPTIMIZER, 0.0, 0.0, trained * 4 if plan.foreach_optimizer else 2 * biggest * 4),
    ]
    phase, acts, logits, transient = max(phases, key=lambda ph: ph[1] + ph[2] + ph[3])
    c = math.ceil
    return MemoryBreakdown(weights_bytes=c(weights), gradients_bytes=c(grads), optimizer_bytes=c(opt),
                           activations_bytes=c(acts), logits_bytes=c(logits), transient_bytes=c(transient),
                           peak_phase=phase, published_bytes=plan.published_versions * published_bytes(shape, plan))


def published_bytes(shape: ModelShape, plan: TrainPlan) -> int:
    """One policy version's weights (fp32 masters under autocast) as the fullest rank of `plan` publishes them."""
    w = 4 if plan.precision is Precision.AUTOCAST_BF16 else plan.precision.element_bytes[0]
    return published_share_bytes(shape, devices=plan.devices, tp=plan.tp, ep=plan.ep, element_bytes=w,
                                 fsdp_shards=plan.dp * plan.sp if plan.fsdp else 0, lora_params=plan.lora_params)


def predict_kv_cache_bytes(shape: ModelShape, tokens: int, *, dtype_bytes: int = 2, tp: int = 1) -> int:
    """KV cache on one device for `tokens` cached tokens (all of an engine's sequences together):
    2 (K and V) x layers x kv_heads x head_dim x bytes per token; kv heads split by tp (replicated past it).
    """
    return tokens * 2 * shape.num_layers * math.ceil(shape.num_kv_heads / tp) * shape.head_dim * dtype_bytes


def predict_rollout_bytes(shape: ModelShape, tokens: int, *, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Weights of an inference engine (split by tp) plus its KV cache for `tokens` tokens."""
    weights = _device_params(shape, tp) * dtype_bytes
    return math.ceil(weights) + predict_kv_cache_bytes(shape, tokens, dtype_bytes=dtype_bytes, tp=tp)
