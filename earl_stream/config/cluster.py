"""The sections of how a run's processes are connected, planned and placed: the data plane (`store`), the
supervisor, the plan selector, the launcher (Ray, Slurm), security and the sandbox of untrusted code. Pure types with each field's help
and rule; a `selector.plans` that names unknown layouts is refused in `earl_stream.config.validate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from earl_stream.config.fields import field as _f


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
    reserve_bytes: int = _f(1 << 30, "memory kept free for what the model does not count (runtime, allocator); "
                            "each trainer layout adds the largest recent excess of its measured peaks over the "
                            "model's predictions (see learn_reserve)", minimum=0)
    learn_reserve: str = _f("auto", "learn each trainer layout's reserve from its measured step peaks: auto = where "
                            "the peak counts tensor bytes, as the model predicts them (CUDA's allocator), not from "
                            "a CPU process's resident high-water mark, which also holds the interpreter's and the "
                            "allocator's own growth; always = from either; never = the constant reserve_bytes only",
                            choices=("auto", "always", "never"))
    memory_model_scale: float = _f(1.0, "a debugging knob: the trainer selector's memory predictions are multiplied "
                                   "by this (< 1: a model that under-predicts on purpose, to exercise the recovery "
                                   "from allocation failures; trainer.oom_recovery); leave it at 1", minimum=0)
    cost_model_path: str = _f("", "JSON of a step cost-model calibration to start from (StepCostModel.to_dict(), "
                              "or a file with it under \"cost_model\", as bench/cost_calibration.py writes for a "
                              "model on this machine's trainer pool); empty = defaults (a GPU node's)")
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
    num_gpus: float = _f(0.0, "Ray GPUs each process of this role reserves; 0 in every role = launcher.gpus decides; "
                         "set in any role, every role reserves its own setting", minimum=0)
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
    gpus: str = _f("split", "the local and Ray launchers: split = the trainer ranks see the first trainer.nproc "
                   "visible GPUs and each rollout worker one of the others, round-robin (with none left over, the "
                   "workers take the visible GPUs round-robin); shared = every process sees every visible GPU "
                   "(CUDA_VISIBLE_DEVICES as `up` got it). On Ray as amounts of Ray's GPU resource (Ray picks the "
                   "devices); shared reserves none. Pools on the CPU are not placed",
                   choices=("split", "shared"))
    ray: RayLauncherConfig = dataclasses.field(default_factory=RayLauncherConfig)
    slurm: SlurmLauncherConfig = dataclasses.field(default_factory=SlurmLauncherConfig)


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    encrypt: bool | None = _f(None, "encrypt both planes with keys derived from the cluster secret: the control plane "
                              "with ZMQ CURVE, data-plane frames with ChaCha20 under their MACs "
                              "(earl_stream/security/encryption.py), and the HTTP endpoints with TLS; shared memory "
                              "and UCX bytes are not encrypted, so UCX is not used. auto (the default) = on when "
                              "the launcher places processes on other hosts (ray, slurm, any launcher but local), "
                              "off for a local run (the fast path; `up` logs which). Workers started by hand then "
                              "need `--encrypt`")
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
        return self.tls or bool(self.encrypt)

    @property
    def metrics_auth_on(self) -> bool:
        """Whether the metrics endpoints require the read-only key."""
        return self.metrics_auth or self.tls_on


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    mode: str = _f("bwrap", "where untrusted code runs (earl_stream/sandbox): agent programs, and environments from "
                   "outside this project (a file, another package's module or entry point; reset and step run in a "
                   "child of the rollout worker): bwrap = bubblewrap, a filesystem of only the interpreter, the "
                   "installed packages and the environment's own files (no run directory, secret, keys or "
                   "checkpoints), uid 65534, no network (agent programs: a socket to the worker's OpenAI endpoint); "
                   "falls back to process, with a warning, where bwrap is missing or cannot make its namespaces "
                   "(scripts/install-sandbox.sh installs it); process = a child under the limits below, seeing this "
                   "host's files and network; none = in the worker, no limits (debugging)",
                   choices=("none", "process", "bwrap"))
    cpu_seconds: float = _f(120.0, "CPU seconds a sandboxed process may use past the start of its latest episode "
                            "(environments: of its latest reset or step); past it the process is killed and the "
                            "episodes running in it fail with sandbox_limit: cpu", minimum=1)
    memory_bytes: int = _f(4 << 30, "memory a sandboxed process may hold (all the episodes it runs at once); past it "
                           "the kernel kills it and its episodes fail with sandbox_limit: memory", minimum=64 << 20)
    processes: int = _f(256, "processes and threads a sandboxed process may have at once; a fork past it fails "
                        "(counted as sandbox_limit: processes when its episode fails)", minimum=8)
    wall_seconds: float = _f(20.0, "seconds one reset or step of a sandboxed environment may run; past it its process "
                             "is killed and the episodes it serves fail with sandbox_limit: wall (keep it below the "
                             "agent loop's 30 s step timeout; agent programs have their episode's timeout instead)",
                             minimum=1)
