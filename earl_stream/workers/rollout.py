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
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.chat import ChatFormat
from earl_stream.config import EnvSpec
from earl_stream.env import env_options, make_env, resolve_env
from earl_stream.episodes import TRANSCRIPTS_KEPT, transcript_key
from earl_stream.errors import EarlError, EngineError, EnvError, StoreError
from earl_stream.modeling import load_model, load_tokenizer
from earl_stream.records import SampleRecord
from earl_stream.security import load_secret
from earl_stream.store.client import ShardClient
from earl_stream.store.experience import ExperienceWriter
from earl_stream.store.node import ShardNode
from earl_stream.store.weights import pull_weights
from earl_stream.tools import with_tools
from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, episode_sample_seed, play_episode
from earl_stream.workers.common import StopFlag, model_path, pin_to_cpus, register
from earl_stream.workers.engines.base import Engine, EngineCapacity
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.registry import make_engine

log = logging.getLogger(__name__)


class RolloutWorker:
    def __init__(self, supervisor: str, *, host: str = "127.0.0.1") -> None:
        self.host = host
        self.stop = StopFlag()
        secret = load_secret()
        self.client = P.ControlClient(supervisor, secret=secret)
        self.hb_client = P.ControlClient(supervisor, secret=secret)  # heartbeats never wait behind other calls
        self.node = ShardNode(host, secret=secret)
        self.metrics_address = M.start_metrics_server(host)
        reg, self.cfg = register(self.client, P.Role.ROLLOUT, host=host, shard_address=self.node.address,
                                 metrics_address=self.metrics_address)
        self.worker_id = reg.worker_id
        self.target_version, self.weights_address = reg.policy_version, reg.weights_address
        self.writer = ExperienceWriter(self.node, self.worker_id)
        self.store_client = ShardClient(secret=secret, transport=self.cfg.store.transport)
        pin_to_cpus(self.cfg.rollout.cpus, self.cfg.rollout.threads)
        with self._heartbeats_during("engine start"):  # vLLM starts in 30-60 s on CPU, longer than a lease
            self.engine = self._make_engine()
        self.chat = ChatFormat(self.tokenizer)
        self.envs = {e.display_name: e for e in self.cfg.envs}
        self.envs_version = 0
        self.plan_version = 0
        self.transcripts: deque[str] = deque()
        self.env_errors: dict[str, str] = {}
        self.episodes_done = 0
        self.tokens_generated = 0
        self.inflight = 0
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
        """The configured backend; only the built-in engine needs the model in this process."""
        model_dir = model_path(self.cfg)
        model = None
        if self.cfg.rollout.engine == "torch":
            model, self.tokenizer = load_model(model_dir)
            model.eval()
        else:
            self.tokenizer = load_tokenizer(model_dir)
        return make_engine(self.cfg.rollout.engine, model_dir, model, max_batch_size=self.cfg.rollout.max_batch_size,
                           seed=self.cfg.seed)

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self.node.close()
            self.store_client.close()
            self.client.close()
            self.hb_client.close()
            close = getattr(self.engine, "close", None)
            if close is not None:
                close()
            log.info("%s stopped after %d episodes", self.worker_id, self.episodes_done)

    async def _main(self) -> None:
        self.batcher = AsyncBatcher(self.engine, max_batch_size=self.cfg.rollout.max_batch_size)
        self.version_changed = asyncio.Condition()
        slots = [asyncio.create_task(self._group_slot(i)) for i in range(self.cfg.rollout.groups_in_flight)]
        self._slots = slots
        try:
            await self._heartbeat_loop()
        finally:
            for task in slots:
                task.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            self.batcher.close()

    async def _heartbeat_loop(self) -> None:
        period = self.cfg.supervisor.heartbeat_s
        while not self.stop:
            for task in self._slots:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            stats: dict[str, float] = {"episodes": self.episodes_done, "tokens": self.tokens_generated, "inflight": self.inflight,
                     "policy_version": self.engine.policy_version, "store_bytes": self.node.bytes_held}
            try:
                reply = await asyncio.to_thread(self.hb_client.call, P.Heartbeat(
                    worker_id=self.worker_id, stats=stats, envs_version=self.envs_version, env_errors=self.env_errors))
            except EarlError as exc:
                log.warning("heartbeat failed: %s", exc)
                await asyncio.sleep(period)
                continue
            if not reply.known:
                reg, _ = await asyncio.to_thread(register, self.hb_client, P.Role.ROLLOUT, host=self.host,
                                                 shard_address=self.node.address,
                                                 metrics_address=self.metrics_address, worker_id=self.worker_id)
                self.worker_id = reg.worker_id
                continue
            if reply.plan_json:
                await self._apply_plan(reply.plan_json)
            if reply.envs_json:
                await asyncio.to_thread(self._update_envs, reply.envs_json, reply.envs_version)
            if reply.free_sample_ids:
                self.writer.free(reply.free_sample_ids)
            if reply.stop:
                self.stop.set()
                break
            if reply.policy_version != self.engine.policy_version and reply.weights_address:
                await self._load_weights(reply.policy_version, reply.weights_address)
            M.STORE_BYTES_HELD.labels(self.worker_id).set(self.node.bytes_held)
            M.STORE_SHARDS_HELD.labels(self.worker_id).set(self.writer.samples_held)
            await asyncio.sleep(period)

    async def _apply_plan(self, plan_json: str) -> None:
        plan = json.loads(plan_json)
        if plan["version"] == self.plan_version:
            return
        self.plan_version = plan["version"]
        capacity = EngineCapacity(int(plan["max_concurrent_sequences"]), int(plan["kv_budget_tokens"]))
        await self.batcher.run_exclusive(lambda: self.engine.set_capacity(capacity))
        log.info("adopted rollout plan v%d: %d concurrent sequences, KV budget %d tokens (%s)", self.plan_version,
                 capacity.max_concurrent_sequences, capacity.kv_budget_tokens, plan["reason"])

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

    def _update_envs(self, envs_json: str, version: int) -> None:
        """Adopt the supervisor's environment set; import new ones now so failures are reported."""
        for raw in json.loads(envs_json):
            spec = EnvSpec(**raw)
            name = spec.display_name
            if name in self.envs and self.envs[name] == spec:
                continue
            try:
                resolve_env(spec.spec)
            except EnvError as exc:
                self.env_errors[name] = str(exc)
                log.warning("cannot load environment %s (%s): %s", name, spec.spec, exc)
                continue
            self.env_errors.pop(name, None)
            self.envs[name] = spec
            log.info("environment %s (%s) is ready", name, spec.spec)
        self.envs_version = version

    async def _load_weights(self, version: int, address: str) -> None:
        start = time.monotonic()
        try:
            state = await asyncio.to_thread(pull_weights, self.store_client, address, version)
        except StoreError as exc:
            log.warning("could not pull policy version %d from %s: %s", version, address, exc)
            return
        await self.batcher.run_exclusive(lambda: self.engine.load_state_dict(state, version))
        M.ROLLOUT_WEIGHT_SYNC.labels(self.worker_id).observe(time.monotonic() - start)
        log.info("loaded policy version %d in %.2fs", version, time.monotonic() - start)
        M.ROLLOUT_POLICY_VERSION.labels(self.worker_id).set(version)
        async with self.version_changed:
            self.version_changed.notify_all()

    async def _group_slot(self, slot: int) -> None:
        for n in itertools.count():
            if self.stop:
                break
            # a retry after a lost reply re-sends this id and gets the same prompt, not a second one
            reply = await self._call(P.RequestPrompts(worker_id=self.worker_id, max_groups=1,
                                                      request_id=f"{slot}.{n}"))
            if not reply.prompts:
                await asyncio.sleep(0.05)
                continue
            prompt = reply.prompts[0]

            def ready(version: int = prompt.min_policy_version) -> bool:
                return self.engine.policy_version >= version or bool(self.stop)

            async with self.version_changed:
                await self.version_changed.wait_for(ready)
            records = await self._play_group(prompt)
            if records is None:
                await self._call(P.PutMeta(worker_id=self.worker_id, failed_groups=[prompt.group_id]))
                continue
            rows = await asyncio.to_thread(self.writer.put, records)
            await asyncio.to_thread(self._keep_transcripts, records)
            await self._call(P.PutMeta(worker_id=self.worker_id, rows=rows))

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
            envs = [with_tools(make_env(spec.spec, spec.params)) for _ in range(prompt.group_size)]
        except EnvError as exc:
            log.warning("cannot create environment %s for %s: %s", spec.spec, prompt.group_id, exc)
            return None
        self.inflight += len(envs)
        M.ROLLOUT_INFLIGHT.labels(self.worker_id).set(self.inflight)
        try:
            results = await asyncio.gather(*[
                play_episode(env, env_options(env), self.chat, self.batcher, env_name=prompt.env, seed=prompt.seed,
                             prompt_ordinal=prompt.prompt_ordinal, group_id=prompt.group_id, sampling=sampling,
                             policy_version=lambda: self.engine.policy_version, decode=self.tokenizer.decode,
                             sample_seed=episode_sample_seed(prompt.seed, i))
                for i, env in enumerate(envs)], return_exceptions=True)
        finally:
            self.inflight -= len(envs)
            M.ROLLOUT_INFLIGHT.labels(self.worker_id).set(self.inflight)
        records = []
        for r in results:
            if isinstance(r, (EpisodeFailed, EngineError)):
                log.warning("episode of %s failed: %s", prompt.group_id, r)
                return None
            if isinstance(r, BaseException):
                raise r
            records.append(r)
            self.episodes_done += 1
            self.tokens_generated += r.response_tokens
            M.ROLLOUT_TOKENS.labels(self.worker_id).inc(r.response_tokens)
            M.ROLLOUT_EPISODES.labels(self.worker_id, r.env, str(r.info.get("outcome", ""))).inc()
            M.ROLLOUT_EPISODE_REWARD.labels(self.worker_id, r.env).observe(r.reward)
            M.ROLLOUT_CONTEXT_TOKENS.labels(self.worker_id, r.env).observe(r.num_tokens)
        return records


def run_rollout_worker(supervisor: str, host: str = "127.0.0.1") -> None:
    RolloutWorker(supervisor, host=host).run()
