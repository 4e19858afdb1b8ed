"""The sections of what plays episodes: the environments (`envs`), the rollout workers and their engine,
and evaluation during training. Pure types with each field's help and rule; whether an evaluated
environment can give held-out items is checked in `earl_stream.config.validate`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from earl_stream.config.fields import field as _f

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
    limits: dict[str, float] = _f({}, "this environment's agent processes' sandbox limits, each overriding sandbox.*'s: "
                                  "cpu_seconds, memory_bytes, processes (e.g. {cpu_seconds: 600})")
    network: list[str] = _f([], "host:port its agent programs may reach besides the worker's endpoint; under "
                            "sandbox.mode=bwrap any entry gives them the host's network (no per-address filter)")

    @property
    def display_name(self) -> str:
        return self.name or self.spec.rsplit(":", 1)[-1].lower()


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    workers: int = _f(2, "rollout worker processes started by `up`", minimum=0)
    engine: str = _f("torch", "inference engine backend", choices=("torch", "vllm", "sglang"))
    groups_in_flight: int = _f(8, "prompt groups each worker plays concurrently", minimum=1)
    max_batch_size: int = _f(64, "sequences per engine forward pass", minimum=1)
    prefill_chunk_tokens: int = _f(512, "the built-in engine prefills a long prompt this many positions per forward, "
                                   "appending to its KV cache chunk by chunk (same tokens and log-probs): a prefill's "
                                   "transient memory is then one chunk's activations and chunk x context mask, not the "
                                   "whole prompt's (the rollout memory model counts the chunk). 512: on the 2-layer "
                                   "test model a 4,096-token prefill peaks at a fifth of the memory and takes less CPU "
                                   "time (a whole prefill attends through a full n x n mask); 256 saves a little more "
                                   "memory but ran slower on a loaded host (docs/history.md); 0 = whole prompts",
                                   minimum=0)
    join_running_batch: bool = _f(True, "the built-in engine admits a request into a batch already decoding "
                                  "(continuous batching); false: each batch runs to completion")
    batch_invariant: str = _f("auto", "a seeded episode samples exactly the same tokens whichever episodes share its "
                              "engine batch and whenever they joined it: the built-in engine runs fixed-shape matmuls "
                              "and attention reductions (other batching changes logits by ~1e-6, enough to flip a "
                              "rare sampled token, so a run would depend on the machine's load). auto = always where "
                              "trainer.max_staleness=0 (the on-policy run, which then plays what the synchronous loop "
                              "plays) with the built-in engine, else never; always costs rollout throughput (see "
                              "docs/troubleshooting.md). While on, the selector reports its live cost-model refits "
                              "but does not adopt them: plans picked from measured step times would depend on load",
                              choices=("auto", "always", "never"))
    weight_swap: str = _f("auto", "how a rollout engine loads a new policy version: drain = admissions stop until the "
                          "running rows end; interrupt = running rows stop at the next decode step and their contexts "
                          "are prefilled again under the new weights; inplace = the weights load between two decode "
                          "steps and rows keep their KV. Tokens carry the version that sampled them in every mode. "
                          "auto = inplace on the built-in engine (measured no slower than drain, and interrupt slightly "
                          "slower: docs/history.md), drain on vllm and sglang (drain only)",
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

    def invariant_batches(self, max_staleness: int) -> bool:
        """`batch_invariant` resolved: auto = always at trainer.max_staleness=0 with the built-in engine."""
        if self.batch_invariant != "auto":
            return self.batch_invariant == "always"
        return max_staleness == 0 and self.engine == "torch"

    @property
    def swap_mode(self) -> str:
        """`weight_swap` with `auto` resolved for `engine`: inplace on the built-in engine, drain elsewhere."""
        if self.weight_swap != "auto":
            return self.weight_swap
        return "inplace" if self.engine == "torch" else "drain"


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training (`earl_stream.supervisor.eval_rounds`): held-out items (or evaluation seeds,
    `earl_stream.env.seeds`) played by the rollout pool between training episodes, never trained on. Checked in
    `earl_stream.evaluation.heldout`."""

    every: int = _f(0, "evaluate when the policy version reaches a multiple of this (and at version 0); 0 = off",
                    minimum=0)
    envs: list[str] = _f([], "names of environments in `envs` to evaluate on their held-out items (items their "
                         "training params never pose; for one without a held-out set, such as a game, seeds the run "
                         "never issues for training); empty = every one")
    problems: int = _f(64, "held-out items per environment and evaluation", minimum=1)
    samples: int = _f(1, "episodes per item; pass@k is reported for k = 1..samples", minimum=1)
    temperature: float = _f(0.0, "sampling temperature of evaluation episodes (0 = greedy)", minimum=0)
    share: float = _f(0.5, "at most this fraction of a rollout worker's groups_in_flight slots plays evaluation "
                      "episodes at once (at least one): the rest keeps playing training groups", minimum=0)
    final_timeout_s: float = _f(600.0, "after the run's last step (`steps`), seconds the trainer waits for the round of "
                                "the final version, which the whole rollout pool then plays (as verl validates after "
                                "its last step); 0 = the run ends without it", minimum=0)
