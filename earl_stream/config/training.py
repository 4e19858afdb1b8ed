"""The sections of what is trained and how: the model (and its LoRA adapters), the trainer pool, the
learning algorithm (and on-policy distillation). Pure types with each field's help and rule; the
cross-field checks that need the model or the estimator registry are `earl_stream.config.validate`'s.
"""

from __future__ import annotations

import dataclasses
import os

from earl_stream.config.fields import field as _f

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on a frozen base (`earl_stream.model.lora`); checked against the model at load."""

    enabled: bool = _f(False, "train LoRA adapters on a frozen base instead of the whole model; only the adapters "
                       "get gradients and AdamW state and only they cross the store as weights")
    rank: int = _f(16, "rank r of each adapter (A: [r, in], B: [out, r])", minimum=1)
    alpha: float = _f(32.0, "scaling numerator: an adapter adds alpha / rank x B A to its layer", minimum=0)
    dropout: float = _f(0.0, "dropout on the adapters' input while training", minimum=0)
    target_modules: list[str] = _f(LORA_TARGETS, "module names (suffixes) that get adapters; default: the attention "
                                   "and MLP projections")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = _f("", "directory of a Hugging Face causal LM + tokenizer (~ and $VARS expanded when the config is "
                   "loaded), or a Hugging Face Hub id org/name (a local folder of that name wins); empty = the "
                   "embedded tiny model; default:<game> = the embedded model of that game (default:tictactoe_image: "
                   "a tiny vision-language model that plays from pictures)")
    revision: str = _f("", "branch, tag or commit of a Hub id model.path (empty = main); `up` pins it to the commit it "
                       "resolves to, which every worker loads")
    manifest: dict[str, str] = _f({}, "set by `up` for a Hub model (leave empty): sha256 of each file of the pinned "
                                  "snapshot; a worker whose cached copy differs refuses to start")
    warm_start_steps: int = _f(1350, "supervised warm-start steps of the embedded model (built once per value, "
                               "then cached)", minimum=0)
    warm_start_seconds: float = _f(1800.0, "upper bound on the warm start's wall time (the embedded vision-language "
                                   "model's 1,350 steps take ~16 min on 2 CPU cores)", minimum=0)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    freeze_vision: bool = _f(False, "a vision-language model (Idefics3 / SmolVLM): train the language model only; its "
                             "vision tower and connector keep their weights (no gradients, no optimizer state)")

    def __post_init__(self) -> None:
        # expanded once, where the config is loaded, so every process gets the same absolute path
        if isinstance(self.path, str) and self.path:
            object.__setattr__(self, "path", os.path.expanduser(os.path.expandvars(self.path)))


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    nproc: int = _f(1, "trainer ranks (torch.distributed, gloo on CPU)", minimum=1)
    lr: float = _f(5e-4, "AdamW learning rate", minimum=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", minimum=0)
    groups_per_step: int = _f(8, "prompt groups per training step", minimum=1)
    group_size: int = _f(8, "episodes per prompt group (estimators with a group baseline need >= 2)", minimum=1)
    max_staleness: int = _f(1, "train no token sampled by a policy more than this many versions older than the "
                            "one being trained (older tokens are masked; a group with none left is played again)",
                            minimum=0)
    micro_batch_tokens: int = _f(8192, "token budget of one micro-batch", minimum=1)
    packing: bool = _f(True, "pack a micro-batch's rows into one sequence (position ids restarting per row, attention "
                       "within each row) instead of right-padding them to the longest")
    dynamic_sp_tokens: int = _f(0, "dynamic sequence parallelism per micro-batch (as verl's dynamic context "
                                "parallelism): under a plan of N > 1 data ranks and sp=1 (dpN, fsdpN), a row of more "
                                "than this many tokens is trained by all N ranks together, in a micro-batch of its "
                                "own, with Ulysses sp=N (each rank a contiguous 1/N of its tokens; N must divide the "
                                "model's attention heads), while the step's other rows stay at sp=1 on their own "
                                "ranks; only the degrees 1 and N are chosen; off under a plan with sp > 1, refused "
                                "under tensor parallel; 0 = off", minimum=0)
    threads: int = _f(1, "torch threads per trainer rank", minimum=1)
    cpus: str = _f("", "CPU ids each trainer rank is pinned to, e.g. '1' or '0-1' (torch threads = their count); "
                   "empty = no pinning")
    checkpoint_every: int = _f(100, "write a checkpoint every this many steps (and at the end)", minimum=1)
    stop_grace_s: float = _f(120.0, "seconds `up` (and `worker --nproc`) give a stopping trainer rank to finish its step "
                             "and write its checkpoint before it is killed; other processes get 15 s", minimum=1)
    claim_timeout_s: float = _f(600.0, "give up waiting for a step's samples after this long", minimum=1)
    device: str = _f("auto", "where the trainer computes: auto = cuda when available, else cpu (the collective "
                     "backend follows: nccl on cuda, gloo on cpu)", choices=("auto", "cpu", "cuda"))
    dtype: str = _f("fp32", "compute precision: bf16 = bf16 autocast with fp32 master weights and optimizer state",
                    choices=("fp32", "bf16"))
    malloc_mmap_threshold: int = _f(0, "on a CPU rank (glibc): allocations of at least this many bytes get pages of their "
                                    "own, returned to the OS when freed, so that resident memory follows live tensors as "
                                    "the memory model assumes (e.g. 65536 where a rank's memory is capped; steps are "
                                    "slower); 0 = glibc's default, whose freed blocks stay in its heap", minimum=0)
    reshard_bucket_bytes: int = _f(64 << 20, "a plan switch moves parameters and optimizer state shard to shard, at most "
                                   "this many bytes of whole tensors at a time (a larger tensor alone)", minimum=1 << 20)
    oom_recovery: bool = _f(True, "a step that fails to allocate (CUDA out of memory; on CPU the allocator's failure) is "
                            "abandoned with its gradients, the supervisor corrects its memory model for that plan and "
                            "re-plans, and the same batch trains under the new plan; off = the rank dies as before "
                            "(for debugging)")
    oom_abort_seconds: float = _f(5.0, "after an allocation failure on one rank, how long the pool's other ranks take at "
                                  "most to leave the step (ranks blocked in a collective included) and to agree before "
                                  "the pool re-forms; a rank that does not answer in time fails the pool as before (it "
                                  "resumes from its last checkpoint)", minimum=0.1)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (`earl_stream.algo.distill`): a teacher scores the student's sampled tokens."""

    teacher: str = _f("", "Hugging Face model directory of the teacher (its tokenizer must equal the student's); "
                      "empty = off")
    coef: float = _f(0.1, "weight of the per-token reverse KL (student log-prob - teacher log-prob)", minimum=0)
    mode: str = _f("reward", "reward: the episode's summed reverse KL is subtracted from its reward before the "
                   "advantages; loss: coef x k2 estimate of the reverse KL per loss token in the policy loss",
                   choices=("reward", "loss"))

    @property
    def enabled(self) -> bool:
        return bool(self.teacher) and self.coef > 0

    def __post_init__(self) -> None:
        if isinstance(self.teacher, str) and self.teacher:
            object.__setattr__(self, "teacher", os.path.expanduser(os.path.expandvars(self.teacher)))


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """The learning algorithm: advantage estimator, loss shape, off-policy handling, optimisation schedule
    (`earl_stream.algo`). Cross-field rules (e.g. an estimator's smallest group): `earl_stream.algo.checks`."""

    advantage: str = _f("grpo", "advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, or "
                        "one registered with earl_stream.algo.advantages.register_estimator")
    std_scale: bool = _f(True, "grpo: divide each group's centred rewards by the group's std")
    loss_agg: str = _f("token-mean", "how per-token losses sum to the step's loss, over the whole step (not per "
                       "micro-batch or rank)", choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    positive_weight: float = _f(1.0, "factor on positive advantages, after the estimator (W-REINFORCE, Zhu et al. "
                                "2025, use 0.1: the policy sharpens on its successes more slowly while its mistakes "
                                "are still pushed down); 1 = off, 0 = learn from mistakes only", minimum=0)
    ppo_epochs: int = _f(1, "passes over each step's batch (ratios are against the log-probs before the first)",
                         minimum=1)
    mini_batches: int = _f(1, "optimizer updates per pass: the step's groups split into this many parts", minimum=1)
    clip_eps_low: float = _f(0.2, "PPO clip: ratios below 1 - clip_eps_low stop pushing down", minimum=0)
    clip_eps_high: float = _f(0.2, "PPO clip: ratios above 1 + clip_eps_high stop pushing up (DAPO clip-higher: "
                              "larger than clip_eps_low)", minimum=0)
    dual_clip_c: float = _f(0.0, "dual-clip bound c > 1 on the loss of negative-advantage tokens (-c * A); 0 = off",
                            minimum=0)
    is_correction: str = _f("tis", "engine/trainer mismatch correction per token: tis = weight by min(ratio, "
                            "tis_cap); mask = weight by the ratio inside [is_mask_low, is_mask_high] and drop the "
                            "token outside (IcePop); none = PPO ratio against the engine's log-probs",
                            choices=("tis", "mask", "none"))
    tis_cap: float = _f(2.0, "truncated importance weight cap C (is_correction=tis)", minimum=0)
    is_mask_low: float = _f(0.5, "lowest trainer/engine probability ratio a token keeps (is_correction=mask)",
                            minimum=0)
    is_mask_high: float = _f(2.0, "highest trainer/engine probability ratio a token keeps (is_correction=mask)",
                             minimum=0)
    kl_coef: float = _f(0.0, "weight of the KL penalty to the initial (reference) policy; 0 = off", minimum=0)
    kl_estimator: str = _f("k3", "KL estimator per token: k1 = log(pi/ref), k2 = (log(pi/ref))^2 / 2, k3 = "
                           "ref/pi - log(ref/pi) - 1", choices=("k1", "k2", "k3"))
    kl_decay_steps: int = _f(0, "the KL weight falls linearly from kl_coef to 0 at this step, and the reference's "
                             "forward stops there (a diffuse start that keeps exploring while the policy is weak, "
                             "then free); 0 = constant", minimum=0)
    kl_in: str = _f("loss", "where the KL penalty goes: loss (a term with its own gradient) or reward (subtracted "
                    "from each sample's reward before the advantages)", choices=("loss", "reward"))
    # 0: where a group's games meet different opponents (envs[].group_seed) a near-deterministic policy still gets
    # advantages, and the bonus spreads mass over the whole vocabulary (illegal replies); it was 0.01 when a
    # group's games shared one opponent (the tuning runs in docs/history.md)
    entropy_coef: float = _f(0.0, "weight of the entropy bonus (keeps groups of one prompt from collapsing to one "
                             "answer, which zeroes their advantages)", minimum=0)
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)", minimum=0)
    # cosine to 0.1 x lr at step 400, then constant: the embedded default's policy jitters less once learnt
    # (with the bonus off, second-half minimum 0.904 against 0.865 at a constant lr with it:
    # the tuning runs in docs/history.md); a real model's config sets its own (configs/smollm2_arithmetic.yaml)
    lr_schedule: str = _f("cosine", "learning rate after warm-up: constant, or cosine down to min_lr_ratio x "
                          "trainer.lr at lr_decay_steps, constant after", choices=("constant", "cosine"))
    warmup_steps: int = _f(0, "steps of linear warm-up from 0 to trainer.lr", minimum=0)
    lr_decay_steps: int = _f(400, "step at which the cosine schedule ends; 0 = the run's `steps`", minimum=0)
    min_lr_ratio: float = _f(0.1, "cosine: the final learning rate as a fraction of trainer.lr", minimum=0)
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal (no signal) and fill the step with "
                                "other groups; the dropped ones count as samples_filtered")
    # MoE models (earl_stream.model.moe, workers.routing_replay); checked against model and engine at load
    routing_replay: str = _f("none", "MoE: rollout = the trainer's routers use the experts the engine chose for each "
                             "token (R3) for the old log-probs, the loss and the KL reference's forward; none = they route on their "
                             "own",
                             choices=("none", "rollout"))
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)

    @property
    def updates(self) -> int:
        """Optimizer updates per training step."""
        return self.ppo_epochs * self.mini_batches
