"""The rollout worker: an inference engine, an asyncio agent loop over many concurrent episodes,
and a shard node that keeps the finished samples until the trainer pulls them.

Loop: ask the supervisor for prompt groups, play each group's episodes (batched across episodes by
the engine's batcher), put the records into the local store and send their metadata rows; a
heartbeat task follows the policy version and pulls new weights from the trainer's shard node,
loading them between engine batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from earl_stream import metrics as M
from earl_stream import openai_api
from earl_stream import protocol as P
from earl_stream.config import EnvSpec
from earl_stream.devices import resolve_device
from earl_stream.env import resolve_env, seeds_per_episode
from earl_stream.env.api import is_agent_env
from earl_stream.errors import ConfigError, EarlError, EngineError, EnvError, StoreError
from earl_stream.evaluation.runner import ItemSpec
from earl_stream.evaluation.worker import play_eval_tasks
from earl_stream.model.chat import ChatFormat
from earl_stream.model.loading import is_vision_dir, load_policy, load_processor, load_tokenizer, torch_dtype
from earl_stream.model.vision import VisionChat
from earl_stream.openai_api.http import bind_socket
from earl_stream.records import TRANSCRIPTS_KEPT, SampleRecord, transcript_key
from earl_stream.security.tls import tls_enabled
from earl_stream.store.client import ShardClient
from earl_stream.store.experience import ExperienceWriter
from earl_stream.store.node import ShardNode
from earl_stream.store.relay import sync_weights
from earl_stream.store.weight_route import WeightRoute
from earl_stream.supervisor.rollout_selector import engine_kv_capacity
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, episode_env_seed, episode_sample_seed, play_episode
from earl_stream.workers.agent_runner import AgentRunners, open_agent_runners
from earl_stream.workers.common import StopFlag, model_path, pin_to_cpus, register, worker_key
from earl_stream.workers.durable import DurableSamples
from earl_stream.workers.engines.base import Engine, EngineCapacity
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.memory import EngineMemory, engine_memory
from earl_stream.workers.engines.registry import make_engine
from earl_stream.workers.engines.weight_swap import SwapMode, SwapTally, swap_weights
from earl_stream.workers.env_runner import EnvRunners, SandboxedAgent, episode_envs, open_env_runners

if TYPE_CHECKING:
    from earl_stream.algo.distill import TeacherScorer

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, supervisor: str, *, host: str = "127.0.0.1", drain_on_term: bool = False) -> None:
        self.host = host
        self.stop = StopFlag(drain_on_term=drain_on_term)
        secret, key_file = worker_key()  # the worker key (or the cluster secret): security/keys.py
        self.secret = secret
        self.client = P.ControlClient(supervisor, secret=secret, key_file=key_file)
        self.hb_client = P.ControlClient(supervisor, secret=secret, key_file=key_file)  # never waits behind other calls
        self.node = ShardNode(host, secret=secret)
        self.metrics_address = M.start_metrics_server(host)
        reg, self.cfg = register(self.client, P.Role.ROLLOUT, host=host, shard_address=self.node.address,
                                 metrics_address=self.metrics_address)
        self.worker_id = reg.worker_id
        self.target_version, self.weights_address = reg.policy_version, reg.weights_address
        self.writer = ExperienceWriter(self.node, self.worker_id)
        # samples persisted by this host's earlier worker are served again before any prompt is asked for
        self.durable = DurableSamples.open(self.cfg, reg.run_id, self.writer)
        if self.durable is not None:
            self.durable.recover(self.client, self.worker_id)
        self.store_client = ShardClient(secret=secret, transport=self.cfg.store.transport)
        pin_to_cpus(self.cfg.rollout.cpus, self.cfg.rollout.threads)
        with self._heartbeats_during("engine start"):  # vLLM starts in 30-60 s on CPU, longer than a lease
            self.engine = self._make_engine()
        # a vision-language policy's episodes render images (model.vision); its endpoint and evaluations take text
        self.chat: ChatFormat | VisionChat = VisionChat(self.processor) if self.processor is not None \
            else ChatFormat(self.tokenizer)
        self.text_chat = self.chat.chat if isinstance(self.chat, VisionChat) else self.chat
        self.teacher = self._make_teacher()
        self.openai_sock, self.openai_url = self._bind_endpoint()
        if self.openai_url:  # the same worker id, now with its endpoint (bound once the run's config was known)
            register(self.client, P.Role.ROLLOUT, host=host, shard_address=self.node.address,
                     metrics_address=self.metrics_address, worker_id=self.worker_id, openai_url=self.openai_url)
        self.envs = {e.display_name: e for e in self.cfg.envs}
        self.envs_version = 0
        self.plan_version = 0
        self.max_episode_tokens = 0  # the rollout plan's bound on an episode's context (0: none)
        self.transcripts: deque[str] = deque()
        self.env_errors: dict[str, str] = {}
        self.episodes_done = 0
        self.tokens_generated = 0
        self.inflight = 0
        self.swaps = SwapTally(self.cfg.rollout.swap_mode)
        self.draining = False  # scaled down: finish the groups held, take no new ones, leave when told
        log.info("%s ready: shards at %s, metrics at %s", self.worker_id, self.node.address, self.metrics_address)

    @contextlib.contextmanager
    def _heartbeats_during(self, what: str) -> Iterator[None]:
        """Heartbeat from a thread while a blocking start-up runs, so the lease does not expire meanwhile."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.cfg.supervisor.heartbeat_s):
                try:
                    self.hb_client.call(P.Heartbeat(worker_id=self.worker_id, stats={"starting": 1.0}))
                except EarlError as exc:
                    log.warning("heartbeat during %s failed: %s", what, exc)

        thread = threading.Thread(target=beat, name="earl-startup-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _make_engine(self) -> Engine:
        """The configured backend; only the built-in engine needs the model in this process. Its memory
        (`self.memory`, reported in heartbeats) is measured before the model loads; the engine starts
        with at most the KV tokens that memory holds, until the supervisor's plan arrives."""
        model_dir, r = model_path(self.cfg), self.cfg.rollout
        model = None
        self.processor = None  # a vision-language policy's
        vision = is_vision_dir(model_dir)
        if r.engine == "sglang" and vision:
            raise ConfigError("model.path holds a vision-language model: rollout.engine=sglang does not take its images "
                              "here yet; use rollout.engine=torch or vllm (Idefics3 / SmolVLM)")
        if r.engine == "torch":
            device = resolve_device(r.device, key="rollout.device", local_rank=int(os.environ.get("LOCAL_RANK", "0")))
            self.memory = engine_memory(r.memory_bytes, str(device), r.workers + self.cfg.trainer.nproc)
            kv_tokens = self._kv_capacity(model_dir, self.memory)
            policy = load_policy(model_dir, dtype=torch_dtype(r.dtype))
            model, self.tokenizer, self.processor = policy
            model.to(device).eval()  # type: ignore[arg-type]
            log.info("built-in engine generates on %s (%s)", device, r.dtype)
        else:  # vLLM and SGLang place and size themselves: no CUDA probe in this process (0: nothing reported)
            self.memory = EngineMemory(r.memory_bytes, "rollout.memory_bytes" if r.memory_bytes else f"{r.engine}'s own")
            kv_tokens = self._kv_capacity(model_dir, self.memory)
            if vision:  # the engine loads the weights; the turns are rendered here
                self.processor = load_processor(model_dir)
                self.tokenizer = self.processor.tokenizer
            else:
                self.tokenizer = load_tokenizer(model_dir)
        lora = self.cfg.model.lora
        return make_engine(r.engine, model_dir, model, max_batch_size=r.max_batch_size, seed=self.cfg.seed,
                           kv_budget_tokens=min(kv_tokens or 65536, 65536), weight_swap=r.swap_mode,
                           lora_rank=lora.rank if lora.enabled else 0,
                           batch_invariant=r.invariant_batches(self.cfg.trainer.max_staleness),
                           prefill_chunk_tokens=r.prefill_chunk_tokens)

    def _lora_stats(self) -> dict[str, float]:
        """How the engine applied LoRA versions (vLLM: `lora_versions_as_adapter` / `lora_versions_merged`)."""
        stats = getattr(self.engine, "lora_stats", None)
        return stats() if callable(stats) else {}

    def _make_teacher(self) -> TeacherScorer | None:
        """algo.distill's teacher (`algo.distill.TeacherScorer`) on the engine's device, or None when off."""
        d = self.cfg.algo.distill
        if not d.enabled:
            return None
        from earl_stream.algo.distill import TeacherScorer  # noqa: F811 (imported for its type above)

        device = resolve_device(self.cfg.rollout.device, key="rollout.device",
                                local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        with self._heartbeats_during("teacher start"):
            return TeacherScorer(d.teacher, self.tokenizer, device=device, temperature=self.cfg.rollout.temperature)

    def _kv_capacity(self, model_dir: Path, memory: EngineMemory) -> int:
        """KV tokens this engine's memory holds (0: unknown); fails at start, saying what the smallest plan
        needs, when that memory cannot hold one."""
        log.info("rollout engine memory: %d MiB (%s)", memory.bytes >> 20, memory.source)
        if not memory.bytes or not self.cfg.selector.enabled:
            return 0
        return engine_kv_capacity(self.cfg, model_dir, memory.bytes, memory.source)

    def _bind_endpoint(self) -> tuple[Any, str]:
        """The OpenAI endpoint's listening socket (rollout.openai_bind) and its advertised URL."""
        bind = self.cfg.rollout.openai_bind
        if not bind:
            return None, ""
        try:
            sock = bind_socket(bind)
        except (OSError, ValueError) as exc:
            raise EarlError(f"rollout.openai_bind={bind!r}: cannot listen there: {exc}") from exc
        host, port = sock.getsockname()[:2]
        advertise = self.host if host in ("0.0.0.0", "::") else host
        return sock, f"{'https' if tls_enabled() else 'http'}://{advertise}:{port}/v1"  # HTTPS: earl_stream/security/tls.py

    def _max_context(self) -> int:
        """The model's context length (the endpoint refuses longer requests)."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_path(self.cfg))
            return int(config.get_text_config().max_position_embeddings)
        except (OSError, ValueError, AttributeError, TypeError):
            return int(min(getattr(self.tokenizer, "model_max_length", 4096), 1 << 20))

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            if self.durable is not None:  # a clean stop (a signal, the run's end): persist what is held
                self.durable.persist(self.durable.version, "stop")
                self.durable.close()
            self.node.close()
            self.store_client.close()
            self.client.close()
            self.hb_client.close()
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
            log.info("%s stopped after %d episodes", self.worker_id, self.episodes_done)

    async def _main(self) -> None:
        self.batcher = AsyncBatcher(self.engine, max_batch_size=self.cfg.rollout.max_batch_size,
                                    join_running=self.cfg.rollout.join_running_batch)
        self.version_changed = asyncio.Condition()
        self.planned = asyncio.Event()  # set by the first heartbeat reply: episodes wait for its plan
        slots = [asyncio.create_task(self._group_slot(i)) for i in range(self.cfg.rollout.groups_in_flight)]
        # what heartbeats deliver that waits on the engine (a plan, a weight swap): applied by its own task
        self._pending_plan: P.RolloutPlan | None = None
        self._pending_weights: tuple[int, str, WeightRoute] | None = None
        self._control_wake = asyncio.Event()
        self._tasks = [*slots, asyncio.create_task(self._engine_control())]
        self._envs_update: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # (_update_envs)
        self._envs_update.set_result(None)
        self.endpoint: openai_api.OpenAIEndpoint | None = None
        self.agent_runners: AgentRunners | None = None
        self.env_runners: EnvRunners | None = open_env_runners(self.cfg, self.worker_id)  # other projects' envs
        if self.env_runners is not None:
            self.env_runners.attach(self.envs.values())  # their sandboxes started ahead of their first episode
        if self.openai_sock is not None:
            r = self.cfg.rollout
            self.endpoint = openai_api.OpenAIEndpoint(
                self.batcher, self.tokenizer, self.text_chat, model=r.openai_model, secret=self.secret,
                max_context=self._max_context(), default_max_tokens=r.openai_max_tokens, temperature=r.temperature,
                top_p=r.top_p, top_k=r.top_k, policy_version=lambda: self.engine.policy_version, worker=self.worker_id,
                non_append=r.non_append)
            await self.endpoint.start(self.openai_sock, self.openai_url.split("//")[1].rsplit(":", 1)[0])
            if r.agent_processes:
                self.agent_runners = await open_agent_runners(self.cfg, self.worker_id, self.endpoint)
        try:
            await self._heartbeat_loop()
        finally:
            if self.endpoint is not None:
                await self.endpoint.close()
            for task in [*self._tasks, self._envs_update]:
                task.cancel()
            await asyncio.gather(*self._tasks, self._envs_update, return_exceptions=True)
            if self.agent_runners is not None:
                await self.agent_runners.aclose()
            if self.env_runners is not None:
                await self.env_runners.aclose()
            self.batcher.close()

    async def _heartbeat_loop(self) -> None:
        period = self.cfg.supervisor.heartbeat_s
        self._persisting: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._persisting.set_result(None)
        while not self.stop:
            for task in [*self._tasks, self._envs_update]:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            stats: dict[str, float] = {"episodes": self.episodes_done, "tokens": self.tokens_generated, "inflight": self.inflight,
                     "policy_version": self.engine.policy_version, "store_bytes": self.node.bytes_held,
                     "memory_bytes": self.memory.bytes, **self.swaps.stats(), **self._lora_stats(),
                     # the built-in engine's load sheds on allocation failures (workers/engines/shedding.py)
                     "oom_sheds": float(getattr(self.engine, "oom_shed_total", 0))}
            sheds = getattr(self.engine, "oom_sheds", ())  # the evidence of the latest one: what it asked, what was held
            try:
                reply = await asyncio.to_thread(self.hb_client.call, P.Heartbeat(
                    worker_id=self.worker_id, stats=stats, envs_version=self.envs_version, env_errors=self.env_errors,
                    leaving=self.stop.leaving, oom_attempted_bytes=(sheds[-1].bytes_attempted or 0) if sheds else 0,
                    oom_in_use_bytes=sheds[-1].bytes_in_use if sheds else 0))
            except EarlError as exc:
                log.warning("heartbeat failed: %s", exc)
                await asyncio.sleep(period)
                continue
            if not reply.known:
                reg, _ = await asyncio.to_thread(register, self.hb_client, P.Role.ROLLOUT, host=self.host,
                                                 shard_address=self.node.address,
                                                 metrics_address=self.metrics_address, worker_id=self.worker_id,
                                                 openai_url=self.openai_url)
                self.worker_id = reg.worker_id
                continue
            if reply.plan is not None:
                self._pending_plan = reply.plan
            if reply.envs_json and self._envs_update.done():  # (in the background: a sandbox may take seconds to
                # start; meanwhile the replies repeat the set, until its version is adopted)
                self._envs_update = asyncio.ensure_future(self._update_envs(reply.envs_json, reply.envs_version))
            if reply.free_sample_ids:
                self.writer.free(reply.free_sample_ids)
            if self.durable is not None and reply.checkpoint_version > self.durable.version and self._persisting.done():
                # in the background: a large store must not hold up the heartbeats (the lease)
                self._persisting = asyncio.ensure_future(asyncio.to_thread(self.durable.persist, reply.checkpoint_version,
                                                                           "checkpoint"))
            if reply.drain != self.draining and not reply.stop:
                self.draining = reply.drain
                log.info("%s: %s", self.worker_id, "draining: no new prompts; staying until the samples held are "
                         "trained and released" if reply.drain else "drain cancelled: taking prompts again")
            if reply.stop:
                if reply.drained:
                    if not self.draining:  # it held nothing when the drain began: drained within one heartbeat
                        log.info("%s: draining: no new prompts; it held no samples, so it drained at once", self.worker_id)
                    log.info("%s drained: every sample it produced is trained and released; leaving", self.worker_id)
                self.stop.set()
                break
            if reply.policy_version != self.engine.policy_version and reply.weights_address:
                self._pending_weights = (reply.policy_version, reply.weights_address,
                                         WeightRoute(reply.weights_relay, reply.weights_via))
            self._control_wake.set()
            M.STORE_BYTES_HELD.labels(self.worker_id).set(self.node.bytes_held)
            M.STORE_SHARDS_HELD.labels(self.worker_id).set(self.writer.samples_held)
            await asyncio.sleep(period)

    async def _engine_control(self) -> None:
        """Apply what the heartbeats deliver that must wait on the engine: a rollout plan (between batches)
        and a new policy version (a drain swap waits for the running rows). Its own task, so a long batch
        never holds up a heartbeat: a worker whose beats waited out a batch once outlived its lease, was
        declared dead and had its groups played again, and the trainer sat idle for a whole rollout after
        each re-plan. The newest of each is applied, the plan first (as the reply gave them); the first
        reply, with the plan sized for this worker's memory, releases the episodes (`planned`)."""
        while True:
            await self._control_wake.wait()
            self._control_wake.clear()
            plan, self._pending_plan = self._pending_plan, None
            if plan is not None:
                await self._apply_plan(plan)
            self.planned.set()
            target, self._pending_weights = self._pending_weights, None
            if target is not None and target[0] != self.engine.policy_version:
                await self._load_weights(*target)

    async def _apply_plan(self, plan: P.RolloutPlan) -> None:
        if plan.version == self.plan_version:
            return
        self.plan_version, self.max_episode_tokens = plan.version, plan.max_episode_tokens
        capacity = EngineCapacity(plan.max_concurrent_sequences, plan.kv_budget_tokens)
        await self.batcher.run_exclusive(lambda: self.engine.set_capacity(capacity))
        log.info("adopted rollout plan v%d: %d concurrent sequences, KV budget %d tokens (%s; %s)", self.plan_version,
                 capacity.max_concurrent_sequences, capacity.kv_budget_tokens, plan.reason, plan.sizing or "-")

    def _keep_transcripts(self, records: list[SampleRecord]) -> None:
        """Readable transcripts of the last episodes, for `earl-stream episodes` (bounded)."""
        for r in records:
            text = self.tokenizer.decode(r.input_ids.tolist(), skip_special_tokens=False)
            assert isinstance(text, str), "one sequence decodes to one string"
            key = transcript_key(r.sample_id)
            self.node.put(key, np.frombuffer(text.encode(), dtype=np.uint8).copy())
            self.transcripts.append(key)
        while len(self.transcripts) > TRANSCRIPTS_KEPT:
            self.node.drop([self.transcripts.popleft()])

    async def _update_envs(self, envs_json: str, version: int) -> None:
        """Adopt the supervisor's environment set, each new environment loaded first so that failures are reported:
        one from outside this project in its sandbox (`EnvRunners.check`; never imported here), any other here. The
        version is adopted once all are loaded (`env attach` waits for it, then reads the errors)."""
        for raw in json.loads(envs_json):
            spec = EnvSpec(**raw)
            name = spec.display_name
            if name in self.envs and self.envs[name] == spec:
                continue
            try:
                if self.env_runners is not None and self.env_runners.wants(spec):
                    await self.env_runners.check(spec)
                else:
                    await asyncio.to_thread(resolve_env, spec.spec)
            except EnvError as exc:
                self.env_errors[name] = str(exc)
                log.warning("cannot load environment %s (%s): %s", name, spec.spec, exc)
                continue
            self.env_errors.pop(name, None)
            self.envs[name] = spec
            log.info("environment %s (%s) is ready", name, spec.spec)
        self.envs_version = version

    async def _load_weights(self, version: int, address: str, route: WeightRoute) -> None:
        """Pull `version` as the supervisor routed it (store.weight_sync): from the trainer ranks, or relayed
        through the rollout worker before this one (and served onwards from this worker's node)."""
        start = time.monotonic()
        try:
            state = await asyncio.to_thread(sync_weights, self.store_client, self.node, address, version, route)
        except StoreError as exc:
            log.warning("could not pull policy version %d from %s: %s", version, address, exc)
            return
        try:
            await swap_weights(self.batcher, self.engine, state, version, SwapMode(self.swaps.mode), self.swaps)
        except EngineError as exc:
            M.ROLLOUT_SWAP_FAILURES.labels(self.worker_id).inc()
            log.warning("policy version %d not loaded, the engine stays on version %d: %s", version,
                        self.engine.policy_version, exc)
            return
        M.ROLLOUT_SWAP_PAUSE.labels(self.worker_id, self.swaps.mode).observe(self.swaps.last_pause_s)
        M.ROLLOUT_SWAP_REPREFILL.labels(self.worker_id).observe(self.swaps.last_reprefill_tokens)
        M.ROLLOUT_WEIGHT_SYNC.labels(self.worker_id).observe(time.monotonic() - start)
        relayed = f" (relayed from {route.via or 'the trainer: first in the chain'})" if route.relay else ""
        log.info("loaded policy version %d in %.2fs%s", version, time.monotonic() - start, relayed)
        M.ROLLOUT_POLICY_VERSION.labels(self.worker_id).set(version)
        async with self.version_changed:
            self.version_changed.notify_all()

    async def _group_slot(self, slot: int) -> None:
        for n in itertools.count():
            if self.stop:
                break
            if self.draining or not self.planned.is_set():
                await asyncio.sleep(0.1)
                continue
            # a retry after a lost reply re-sends this id and gets the same prompt, not a second one
            reply = await self._call(P.RequestPrompts(worker_id=self.worker_id, max_groups=1,
                                                      request_id=f"{slot}.{n}"))
            if reply.eval_tasks:
                await self._play_eval(reply.eval_tasks)
                continue
            if not reply.prompts:
                await asyncio.sleep(0.05)
                continue
            prompt = reply.prompts[0]

            def ready(version: int = prompt.min_policy_version) -> bool:
                return self.engine.policy_version >= version or bool(self.stop)

            async with self.version_changed:
                await self.version_changed.wait_for(ready)
            start = time.monotonic()
            records = await self._play_group(prompt)
            if records is None:
                await self._call(P.PutMeta(worker_id=self.worker_id, failed_groups=[prompt.group_id]))
                continue
            log.info("group %s: %d episodes, %d tokens in %.2fs", prompt.group_id, len(records),
                     sum(len(r.input_ids) for r in records), time.monotonic() - start)
            if self.teacher is not None:  # algo.distill: the teacher scores the episodes before they are stored
                records = await asyncio.to_thread(self.teacher.score, records)
            rows = await asyncio.to_thread(self.writer.put, records)
            await asyncio.to_thread(self._keep_transcripts, records)
            await self._call(P.PutMeta(worker_id=self.worker_id, rows=rows))

    async def _play_eval(self, tasks: list[P.EvalTask]) -> None:
        """Evaluation episodes (eval.every; never trained on): played with weights at least as new as their
        round, only their results sent back (`PutEval`), nothing put in the store (evaluation/worker.py)."""
        version = max(t.version for t in tasks)
        async with self.version_changed:
            await self.version_changed.wait_for(lambda: self.engine.policy_version >= version or bool(self.stop))
        if self.stop:
            return  # the tasks go back to the queue when this worker is gone
        results = await play_eval_tasks(tasks, self.batcher, self.text_chat, self.tokenizer.decode, worker_id=self.worker_id,
                                        policy_version=lambda: self.engine.policy_version,
                                        max_episode_tokens=lambda: self.max_episode_tokens, make=self._eval_env)
        await self._call(P.PutEval(worker_id=self.worker_id, results=results))

    async def _eval_env(self, it: ItemSpec) -> Any:
        """An evaluation item's environment, sandboxed as its training episodes are (`episode_envs`)."""
        known = self.envs.get(it.name)
        spec = EnvSpec(spec=it.spec, name=it.name, params=it.params) if known is None else \
            dataclasses.replace(known, spec=it.spec, params=it.params)
        (env,) = await episode_envs(self.env_runners, spec, 1)
        if isinstance(env, SandboxedAgent):
            raise EnvError(f"{it.name} is an agent environment from outside this project: its episodes run only in "
                           "agent processes, and held-out evaluation plays text episodes")
        return env

    async def _call(self, msg: P.Msg) -> Any:
        """A control call that waits out a supervisor restart (up to the lease of a few minutes)."""
        return await asyncio.to_thread(self.client.call_retry, msg, deadline_s=300, what=type(msg).__name__)

    async def _play_group(self, prompt: P.Prompt) -> list[SampleRecord] | None:
        spec = self.envs.get(prompt.env)
        if spec is None:
            log.warning("prompt %s names unknown environment %r", prompt.group_id, prompt.env)
            return None
        sampling = Sampling(self.cfg.rollout.temperature, self.cfg.rollout.top_p, self.cfg.rollout.top_k)
        try:
            envs = await episode_envs(self.env_runners, spec, prompt.group_size)  # sandboxed where they must be
        except EnvError as exc:
            log.warning("cannot create environment %s for %s: %s", spec.spec, prompt.group_id, exc)
            return None
        self.inflight += len(envs)
        M.ROLLOUT_INFLIGHT.labels(self.worker_id).set(self.inflight)
        try:
            results = await asyncio.gather(*[self._play(env, spec, prompt, i, sampling) for i, env in enumerate(envs)],
                                           return_exceptions=True)
        finally:
            self.inflight -= len(envs)
            M.ROLLOUT_INFLIGHT.labels(self.worker_id).set(self.inflight)
        records = []
        for played in results:
            if isinstance(played, (EpisodeFailed, EngineError)):
                log.warning("episode of %s failed: %s", prompt.group_id, played)
                return None
            if isinstance(played, BaseException):
                raise played
            records += played  # an agent that rewrote its history: one sample per segment (rollout.non_append)
            M.ROLLOUT_SAMPLES_PER_EPISODE.labels(self.worker_id, prompt.env).observe(len(played))
            M.ROLLOUT_SEGMENTS_SPLIT.labels(self.worker_id, prompt.env).inc(len(played) - 1)
            self.episodes_done += 1
        for r in records:
            self.tokens_generated += r.response_tokens
            M.ROLLOUT_TOKENS.labels(self.worker_id).inc(r.response_tokens)
            M.ROLLOUT_CONTEXT_TOKENS.labels(self.worker_id, r.env).observe(r.num_tokens)
            if r.segment == 0:  # per episode, not per segment
                M.ROLLOUT_EPISODES.labels(self.worker_id, r.env, str(r.info.get("outcome", ""))).inc()
                M.ROLLOUT_EPISODE_REWARD.labels(self.worker_id, r.env).observe(r.reward)
        return records


    async def _play(self, env: Any, spec: EnvSpec, prompt: P.Prompt, index: int,
                    sampling: Sampling) -> list[SampleRecord]:
        """One episode's samples: an agent environment through the OpenAI endpoint (a sample per segment), any
        other with the built-in loop (one: its history is only ever appended to)."""
        try:
            seed = episode_env_seed(prompt.seed, index, seeds_per_episode(spec.group_seed, env))
        except EnvError as exc:
            raise EpisodeFailed(str(exc)) from None
        if is_agent_env(env):
            if self.endpoint is None:
                raise EpisodeFailed("agent environments need the OpenAI endpoint (rollout.openai_bind is empty)")
            return await play_agent_episode(env, self.endpoint, env_name=prompt.env, seed=seed,
                                            prompt_ordinal=prompt.prompt_ordinal, group_id=prompt.group_id,
                                            runner=self.agent_runners, spec=(spec.spec, dict(spec.params)),
                                            limits=spec.limits, network=spec.network)
        return [await play_episode(env, None, self.chat, self.batcher, env_name=prompt.env, seed=seed,
                                  prompt_ordinal=prompt.prompt_ordinal, group_id=prompt.group_id, sampling=sampling,
                                   policy_version=lambda: self.engine.policy_version, decode=self.tokenizer.decode,
                                   sample_seed=episode_sample_seed(prompt.seed, index),
                                   max_episode_tokens=lambda: self.max_episode_tokens)]


def run_rollout_worker(supervisor: str, host: str = "127.0.0.1", drain_on_term: bool = False) -> None:
    RolloutWorker(supervisor, host=host, drain_on_term=drain_on_term).run()
