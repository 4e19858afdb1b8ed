"""Typed, frozen configuration of a run: one dataclass per subsystem, loaded from YAML plus dotted
overrides (`trainer.lr=3e-4`), validated once, every problem reported in one `ConfigError`.

The supervisor owns the effective config of a run and hands it to every worker that registers, so a
worker started on another host needs nothing but the supervisor's address.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from earl_stream.config_fields import apply_override, build, parse_cpus
from earl_stream.config_fields import field as _f
from earl_stream.config_fields import field_help as _field_help
from earl_stream.config_fields import to_dict as config_to_dict
from earl_stream.errors import ConfigError

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
                   "loaded); empty = the embedded tiny model")
    warm_start_steps: int = _f(1350, "supervised warm-start steps of the embedded model (built once per value, "
                               "then cached)", minimum=0)
    warm_start_seconds: float = _f(900.0, "upper bound on the warm start's wall time", minimum=0)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        # expanded once, where the config is loaded, so every process gets the same absolute path
        if isinstance(self.path, str) and self.path:
            object.__setattr__(self, "path", os.path.expanduser(os.path.expandvars(self.path)))


GROUP_SEEDS = ("auto", "shared", "per_episode")  # EnvSpec.group_seed


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    spec: str = _f("tictactoe", "entry-point name, module:Class or path/to/file.py:Class")
    name: str = _f("", "name shown in metrics and status; empty = spec")
    weight: float = _f(1.0, "relative share of prompts sampled from this environment", minimum=0)
    params: dict[str, Any] = _f({}, "keyword arguments for the environment's constructor")
    group_seed: str = _f("auto", "what the episodes of a GRPO group reset the environment with: shared = the "
                         "group's seed (one task, GRPO's same prompt); per_episode = a seed each, for environments "
                         "whose seed only draws chance (an opponent's moves), so a group of a near-deterministic "
                         "policy still differs where it errs; auto = per_episode where the environment sets "
                         "seed_per_episode = True (tictactoe, connect_four), else shared",
                         choices=GROUP_SEEDS)

    @property
    def display_name(self) -> str:
        return self.name or self.spec.rsplit(":", 1)[-1].lower()


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    workers: int = _f(2, "rollout worker processes started by `up`", minimum=0)
    engine: str = _f("torch", "inference engine backend", choices=("torch", "vllm", "sglang"))
    groups_in_flight: int = _f(8, "prompt groups each worker plays concurrently", minimum=1)
    max_batch_size: int = _f(64, "sequences per engine forward pass", minimum=1)
    join_running_batch: bool = _f(True, "the built-in engine admits a request into a batch already decoding "
                                  "(continuous batching); false: each batch runs to completion, so a seeded "
                                  "sample does not depend on when its request arrived (padding changes logits "
                                  "by ~1e-6, enough to flip a rare sampled token)")
    weight_swap: str = _f("auto", "how a rollout engine loads a new policy version: drain = admissions stop until the "
                          "running rows end; interrupt = running rows stop at the next decode step and their contexts "
                          "are prefilled again under the new weights; inplace = the weights load between two decode "
                          "steps and rows keep their KV. Tokens carry the version that sampled them in every mode. "
                          "auto = inplace on the built-in engine (1.48x drain's rollout tokens/s in "
                          "bench/results/weight_swap.json), drain on vllm and sglang (drain only)",
                          choices=("auto", "drain", "interrupt", "inplace"))
    temperature: float = _f(1.0, "sampling temperature; the trainer scores samples at the same temperature (its "
                            "log-probs, ratios and entropy are the tempered distribution's, as the engine reports)",
                            minimum=0)
    top_p: float = _f(1.0, "nucleus sampling threshold", minimum=0)
    top_k: int = _f(0, "top-k sampling (0 = off)", minimum=0)
    threads: int = _f(1, "torch threads per rollout worker", minimum=1)
    cpus: str = _f("", "CPU ids each rollout worker is pinned to, e.g. '0' or '0,2-3' (torch threads = their "
                   "count); empty = no pinning")
    device: str = _f("auto", "where the built-in engine generates: auto = this worker's CUDA device when torch "
                     "sees one, else cpu; vllm and sglang place themselves", choices=("auto", "cpu", "cuda"))
    dtype: str = _f("fp32", "weights and compute of the built-in engine (bf16 works on CPU too; the trainer's "
                    "fp32 weights are cast on load); vllm and sglang choose their own", choices=("fp32", "bf16"))
    memory_bytes: int = _f(0, "memory of each rollout worker's engine, which sizes its KV budget (with rollout.dtype); "
                           "0 = derived: the CUDA device's memory where the engine runs on CUDA, else the host's RAM "
                           "(or the process's RLIMIT_AS) shared among this host's rollout workers and trainer ranks",
                           minimum=0)
    openai_bind: str = _f("127.0.0.1:0", "HOST:PORT of each worker's OpenAI-compatible endpoint (port 0 = any free "
                          "port; bearer token = the cluster secret); empty = no endpoint")
    openai_model: str = _f("policy", "model id the OpenAI endpoint serves (requests must name it)")
    openai_max_tokens: int = _f(256, "max_tokens of an OpenAI request that gives none", minimum=1)
    agent_processes: int = _f(1, "processes per worker that run agent environments' programs (their OpenAI "
                              "client's Python off the engine's event loop and core); 0 = in the worker's event "
                              "loop", minimum=0)
    non_append: str = _f("split", "an OpenAI-endpoint request whose messages do not extend its episode's tokens (a "
                         "summarised, truncated or edited history): split = the episode goes on as a new segment, "
                         "each segment a sample of its own sharing the episode's reward and group; refuse = answered "
                         "400 (code non_append_history), nothing generated", choices=("refuse", "split"))

    @property
    def swap_mode(self) -> str:
        """`weight_swap` with `auto` resolved for `engine`: inplace on the built-in engine, drain elsewhere."""
        if self.weight_swap != "auto":
            return self.weight_swap
        return "inplace" if self.engine == "torch" else "drain"


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
    # group's games shared one opponent (bench/results/learning_default_15min.json)
    entropy_coef: float = _f(0.0, "weight of the entropy bonus (keeps groups of one prompt from collapsing to one "
                             "answer, which zeroes their advantages)", minimum=0)
    grad_clip: float = _f(1.0, "max global gradient norm (0 = off)", minimum=0)
    # cosine to 0.1 x lr at step 400, then constant: the embedded default's policy jitters less once learnt
    # (with the bonus off, second-half minimum 0.904 against 0.865 at a constant lr with it:
    # bench/results/learning_seed_per_game*.json); a real model's config sets its own (configs/smollm2_arithmetic.yaml)
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


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    dispatch: str = _f("pull", "pull: consumers pull from producers; central: via one process", choices=("pull", "central"))
    max_bytes_per_node: int = _f(1 << 30, "bytes a shard node holds before producers block", minimum=1 << 20)
    transport: str = _f("auto", "data-plane transport per peer: auto = shared memory on one host, else UCX when "
                        "both sides have ucxx, else TCP", choices=("auto", "shm", "ucx", "tcp"))
    weight_sync: str = _f("auto", "how rollout workers get a new policy version: direct = each pulls it from the trainer "
                          "ranks' shards; relay = a chain, each worker pulls chunks from the one that joined before "
                          "it and serves them on (about one model's transfer time plus a chunk time per worker); "
                          "auto = relay once the rollout pool spans more hosts than the trainer pool (measured "
                          "faster there, bench/dispatch_cluster.py), else direct",
                          choices=("auto", "direct", "relay"))
    durable_experience: bool = _f(True, "rollout workers persist the samples they hold in run_dir/experience at each "
                                  "trainer checkpoint and on a clean stop; a resumed run (or a worker restarted on "
                                  "the same host) trains them instead of playing their prompts again")


@dataclasses.dataclass(frozen=True)
class SupervisorConfig:
    heartbeat_s: float = _f(1.0, "worker heartbeat period", minimum=0.05)
    lease_s: float = _f(10.0, "a worker silent this long is declared dead", minimum=0.1)
    stats_window: int = _f(512, "episodes in the sliding window of reward/length statistics", minimum=1)


@dataclasses.dataclass(frozen=True)
class SelectorConfig:
    enabled: bool = _f(True, "reselect pool plans from observed context-length percentiles")
    context_window: int = _f(512, "episodes in the sliding window of context-length percentiles", minimum=16)
    percentile: str = _f("p99", "statistic that drives re-plans", choices=("p50", "p90", "p99", "max"))
    upper_factor: float = _f(0.9, "re-plan up when the percentile exceeds this x the plan's design length", minimum=0)
    lower_factor: float = _f(0.4, "re-plan down when the percentile falls below this x the design length", minimum=0)
    headroom: float = _f(1.25, "a new plan's design length is the next power of two >= headroom x percentile", minimum=1)
    min_episodes_between: int = _f(64, "episodes between re-plans (a percentile past the design length skips it)",
                                   minimum=0)
    min_episodes: int = _f(16, "episodes the context window must hold before its statistics drive a plan", minimum=1)
    plans: str = _f("", "trainer layouts the selector may choose, '|'-separated as status names them (dp2, fsdp2, "
                    "tp2, sp2, fsdp2_sp2, ...; '+rc' = with full recomputation, e.g. 'fsdp2+rc|dp2'); empty = all")
    initial_seq_len: int = _f(256, "design length of the plan adopted before any episode finishes", minimum=16)
    trainer_memory_bytes: int = _f(0, "per-rank memory budget; 0 = this machine's RAM / 4", minimum=0)
    reserve_bytes: int = _f(1 << 30, "memory kept free for what the model does not count (runtime, allocator)",
                            minimum=0)
    cost_model_path: str = _f("", "JSON of a step cost-model calibration to start from (StepCostModel.to_dict(), "
                              "or a file with it under \"cost_model\" like bench/results/selector.json); empty = defaults")
    cost_model_min_steps: int = _f(8, "refit the cost model from the trainer's measured step times after this many "
                                   "steps, and as often again after that; 0 = never", minimum=0)
    cost_model_window: int = _f(64, "most recent measured training steps the cost model is refit on", minimum=2)
    allow_fsdp: bool = _f(True, "let trainer plans shard weights, gradients and optimizer state (FSDP2) when "
                          "trainer.nproc > 1")
    allow_tp: bool = _f(True, "let trainer plans use tensor parallelism when trainer.nproc > 1")
    allow_sp: bool = _f(True, "let trainer plans use Ulysses sequence parallelism when trainer.nproc > 1")
    allow_ep: bool = _f(True, "let trainer plans shard the experts of a mixture-of-experts model over ranks (expert "
                        "parallelism, tokens dispatched by all-to-all) when trainer.nproc > 1")
    attention: str = _f("eager", "how trainer plans size attention: eager = its s x s scores are stored (eager "
                        "attention; also SDPA's math path, e.g. fp32 with grouped KV heads on CUDA); flash = "
                        "they are not (flash or memory-efficient kernels: bf16 sdpa on CUDA)", choices=("eager", "flash"))


@dataclasses.dataclass(frozen=True)
class RayRoleConfig:
    num_cpus: float = _f(1.0, "Ray CPUs each process of this role reserves", minimum=0)
    num_gpus: float = _f(0.0, "Ray GPUs each process of this role reserves (a trainer rank on cuda: 1)", minimum=0)
    resources: dict[str, Any] = _f({}, "custom Ray resources each process of this role reserves, e.g. "
                                   "{rollout_node: 1}: it runs only on nodes that declare them")


@dataclasses.dataclass(frozen=True)
class RayLauncherConfig:
    address: str = _f("", "Ray cluster to join (HOST:6379, ray://HOST:10001 or auto); empty = this process's "
                      "ray.init context, else $RAY_ADDRESS, else a new single-node Ray instance")
    connect_timeout_s: float = _f(30.0, "give up joining the Ray cluster after this long", minimum=1)
    placement_timeout_s: float = _f(120.0, "give up when a role's processes are not placed after this long "
                                    "(resources the cluster lacks or holds for others)", minimum=1)
    rollout_max_restarts: int = _f(3, "times Ray restarts a rollout worker that dies (it re-registers and "
                                   "rejoins the run); -1 = without limit", minimum=-1)
    supervisor: RayRoleConfig = dataclasses.field(default_factory=RayRoleConfig)
    rollout: RayRoleConfig = dataclasses.field(default_factory=RayRoleConfig)
    trainer: RayRoleConfig = dataclasses.field(default_factory=RayRoleConfig)


@dataclasses.dataclass(frozen=True)
class SlurmLauncherConfig:
    srun: str = _f("srun", "how the launcher runs srun (a path, or a wrapper)")
    trainer_nodes: int = _f(1, "nodes of the allocation the trainer pool spans (one torchrun per node, "
                            "trainer.nproc / trainer_nodes ranks each); the last nodes of the allocation", minimum=1)
    master_port: int = _f(29500, "port of the trainer pool's rendezvous on its first node", minimum=1)
    step_args: str = _f("", "more srun options for every step, space-separated (e.g. --gpus-per-task=1)")
    ready_timeout_s: float = _f(120.0, "give up when the supervisor's step does not listen within this long",
                                minimum=1)


@dataclasses.dataclass(frozen=True)
class LauncherConfig:
    kind: str = _f("local", "how `up` places the processes: local (child processes), ray (actors on a Ray "
                   "cluster), slurm (srun steps inside a Slurm allocation), or a registered launcher "
                   "(earl_stream.cli.launchers)")
    ray: RayLauncherConfig = dataclasses.field(default_factory=RayLauncherConfig)
    slurm: SlurmLauncherConfig = dataclasses.field(default_factory=SlurmLauncherConfig)


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    encrypt: bool = _f(False, "encrypt both planes with keys derived from the cluster secret: the control plane with "
                       "ZMQ CURVE, data-plane frames with ChaCha20 under their MACs (earl_stream/security/encryption.py); "
                       "shared memory and UCX bytes are not encrypted, so UCX is not used. Workers started by "
                       "hand then need `--encrypt`")
    tls: bool = _f(False, "serve the OpenAI and metrics endpoints over HTTPS (on whenever encrypt is): certificates "
                   "from a run CA derived from the cluster secret, whose certificate `up` writes to RUN_DIR/tls/ca.pem "
                   "for clients to trust (earl_stream/security/tls.py), or the files below")
    tls_cert_file: str = _f("", "a server certificate (PEM) for every process instead of the run CA's; it must name "
                            "every host the endpoints are served from (give tls_key_file and tls_ca_file with it)")
    tls_key_file: str = _f("", "the private key (PEM) of tls_cert_file")
    tls_ca_file: str = _f("", "the CA certificate (PEM) that signed tls_cert_file: what agents and Prometheus trust")
    metrics_auth: bool = _f(False, "metrics endpoints answer only requests whose bearer token is the run's read-only "
                            "key (`earl-stream keys derive readonly`; `up` writes it to RUN_DIR/keys/readonly); on "
                            "whenever TLS is")

    @property
    def tls_on(self) -> bool:
        """Whether the HTTP endpoints serve TLS."""
        return self.tls or self.encrypt

    @property
    def metrics_auth_on(self) -> bool:
        """Whether the metrics endpoints require the read-only key."""
        return self.metrics_auth or self.tls_on


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training (`earl_stream.supervisor.eval_rounds`): held-out items played by the rollout
    pool between training episodes, never trained on. Checked in `earl_stream.evaluation.heldout`."""

    every: int = _f(0, "evaluate when the policy version reaches a multiple of this (and at version 0); 0 = off",
                    minimum=0)
    envs: list[str] = _f([], "names of environments in `envs` to evaluate on their held-out items (items their "
                         "training params never pose); empty = every one")
    problems: int = _f(64, "held-out items per environment and evaluation", minimum=1)
    samples: int = _f(1, "episodes per item; pass@k is reported for k = 1..samples", minimum=1)
    temperature: float = _f(0.0, "sampling temperature of evaluation episodes (0 = greedy)", minimum=0)
    share: float = _f(0.5, "at most this fraction of a rollout worker's groups_in_flight slots plays evaluation "
                      "episodes at once (at least one): the rest keeps playing training groups", minimum=0)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = _f(0, "training steps; 0 = run until stopped", minimum=0)
    seed: int = _f(0, "seed of prompts, sampling and initialisation")
    run_dir: str = _f("runs/latest", "where checkpoints, logs and summaries go")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    envs: tuple[EnvSpec, ...] = dataclasses.field(default_factory=lambda: (EnvSpec(),))
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)
    selector: SelectorConfig = dataclasses.field(default_factory=SelectorConfig)
    launcher: LauncherConfig = dataclasses.field(default_factory=LauncherConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)


# Keys that moved to another section: named in the error rather than silently dropped.
_MOVED = {f"trainer.{k}": f"algo.{k}" for k in ("tis_cap", "kl_coef", "entropy_coef", "grad_clip")}
_MOVED["trainer.clip_eps"] = "algo.clip_eps_low and algo.clip_eps_high"
_LIST_DEFAULTS = {"envs": lambda: [config_to_dict(EnvSpec())]}  # `envs.0.spec=X` edits the default environment
__all__ = ["RunConfig", "config_from_dict", "config_to_dict", "config_to_json", "config_to_yaml", "field_help",
           "load_config", "parse_cpus", "replace", "apply_run_override"]


# ---------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Build the effective config: defaults < YAML file < dotted overrides. Raises ConfigError."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(loaded).__name__}")
        raw = loaded or {}
    errors: list[str] = []
    for item in overrides:
        apply_run_override(raw, item, errors)
    cfg = build(RunConfig, raw, "", errors, _MOVED)
    errors.extend(_algo_problems(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    errors: list[str] = []
    cfg = build(RunConfig, raw, "", errors, _MOVED)
    errors.extend(_algo_problems(cfg))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def field_help(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, help) for every leaf field, for `config show --fields`."""
    return _field_help(cls, prefix)


def config_to_json(cfg: RunConfig) -> str:
    return json.dumps(config_to_dict(cfg), sort_keys=True)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def replace(cfg: RunConfig, *overrides: str) -> RunConfig:
    """A copy of `cfg` with dotted overrides applied (validated like a load)."""
    raw = config_to_dict(cfg)
    errors: list[str] = []
    for item in overrides:
        apply_run_override(raw, item, errors)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return config_from_dict(raw)


def apply_run_override(raw: dict[str, Any], item: str, errors: list[str]) -> None:
    """One dotted override (`trainer.lr=3e-4`) of a run's raw config; `envs.0.spec=X` edits the default
    environment when `raw` names none."""
    apply_override(raw, item, errors, _LIST_DEFAULTS)


def _algo_problems(cfg: RunConfig) -> list[str]:
    from earl_stream.algo.checks import algo_problems  # it imports the estimator registry (numpy only)

    out = algo_problems(cfg)
    if cfg.algo.routing_replay != "none":
        from earl_stream.model.moe_checks import routing_replay_problems  # reads the model's config.json

        out.extend(routing_replay_problems(cfg))
    if cfg.algo.distill.enabled:
        from earl_stream.algo.distill import distill_problems  # reads both tokenizers (transformers)

        out.extend(distill_problems(cfg))
    if cfg.model.lora.enabled:
        from earl_stream.model.lora_checks import lora_problems  # reads the model's config (transformers)

        out.extend(lora_problems(cfg))
    if cfg.rollout.weight_swap not in ("auto", "drain") and cfg.rollout.engine in ("vllm", "sglang"):
        out.append(f"rollout.weight_swap={cfg.rollout.weight_swap} is not available with rollout.engine="
                   f"{cfg.rollout.engine}: that backend returns whole turns, so it can neither stop rows at a decode "
                   "step nor say which tokens the old weights sampled (make_engine says more); use "
                   "rollout.weight_swap=drain, or rollout.engine=torch")
    out.extend(_eval_problems(cfg))
    names = [n for n in cfg.selector.plans.split("|") if n]
    bad = [n for n in names if not _LAYOUT_NAME.fullmatch(n)]
    if bad:
        out.append(f"selector.plans: {bad} are not layout names (e.g. dp2, fsdp2, tp2, sp2, fsdp2_sp2, ep2, fsdp2_ep2, "
                   "each optionally with +rc, '|'-separated)")
    if eps := {int(m) for n in names for m in re.findall(r"(?:^|_)ep(\d+)", n)}:
        from earl_stream.model.moe_checks import expert_parallel_problems  # reads the model's config.json

        out.extend(expert_parallel_problems(cfg, sorted(eps)))
    return out


_AXIS = r"(dp\d+|fsdp\d+|tp\d+|sp\d+|ep\d+)"
_LAYOUT_NAME = re.compile(rf"(dp1|{_AXIS}(_{_AXIS})*)(\+rc)?")


def _eval_problems(cfg: RunConfig) -> list[str]:
    """The `eval` section: its environments are configured ones that can give held-out items."""
    if cfg.eval.every <= 0:
        return []
    from earl_stream.evaluation.heldout import HeldOutUnavailable, check_held_out

    out: list[str] = []
    names = {e.display_name: e for e in cfg.envs}
    if cfg.eval.samples > 1 and cfg.eval.temperature <= 0:
        out.append(f"eval.samples={cfg.eval.samples} at eval.temperature=0 plays each item the same greedy way: "
                   "set a temperature above 0 for pass@k with k > 1")
    for name in cfg.eval.envs or list(names):
        if name not in names:
            out.append(f"eval.envs: {name!r} names none of the run's environments {sorted(names)}")
            continue
        try:
            check_held_out(names[name].spec, name)
        except HeldOutUnavailable as exc:
            out.append(f"eval.envs: {exc}")
    return out




