"""A trainer rank: claims each step's batch by metadata, pulls exactly its own rows from the
producers, runs the configured algorithm's updates (`cfg.algo`), all-reduces gradients across ranks, steps the optimizer and (rank 0)
publishes the new policy version as weight shards in its own shard node.

The loop reads top to bottom in `TrainerRank.run`; the math lives in `earl_stream.algo` and
`earl_stream.workers.train_step`.

Stopping: the first SIGTERM or SIGINT (or the supervisor's stop) lets the step in progress finish; the
ranks agree on it at the step boundary (`collectives.any_rank`), so all of them leave at the same step,
publish nothing more, write the checkpoint of that version together (unless one already holds it) and
exit 0. A second signal stops the rank at once (`common.StopFlag`).

Out of memory (`trainer.oom_recovery`): a step that fails to allocate on any rank before an optimizer update
is abandoned by every rank with nothing applied, within `trainer.oom_abort_seconds` (`workers.oom_retry`,
`workers.pool_abort`: the pool's process group is re-formed); rank 0 reports it (`protocol.TrainerOom`),
the supervisor corrects its memory model for that plan and re-plans, and the pool claims the same step
again: the same rows, the new plan. A failure after an optimizer stepped is not retried: the pool resumes
from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.devices import resolve_device
from earl_stream.errors import ConfigError, ControlPlaneTimeout, EarlError
from earl_stream.model import load_policy
from earl_stream.model.lora import LoraSpec, adapter_state, apply_lora, state_bytes
from earl_stream.store.central import CentralClient, start_dispatcher_process
from earl_stream.store.client import ShardClient
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import table_from_ipc, table_to_metas
from earl_stream.store.weights import drop_weights, publish_weights
from earl_stream.workers import checkpoint as ckpt
from earl_stream.workers.collectives import all_gather_flags, all_gather_str, any_rank, broadcast_bytes, broadcast_str, max_over_ranks
from earl_stream.workers.common import RENDEZVOUS_ENV, StopFlag, model_path, pin_to_cpus, register, worker_key
from earl_stream.workers.final_eval import await_final_eval
from earl_stream.workers.host_memory import free_unused_memory, set_malloc_mmap_threshold
from earl_stream.workers.mesh import RankPlan, TrainerMesh, pool_backend
from earl_stream.workers.oom_retry import OomRetry
from earl_stream.workers.oom_step import cap_address_space
from earl_stream.workers.peak_memory import PeakMemory
from earl_stream.workers.sharding import apply_plan, relayout, shard_pieces
from earl_stream.workers.tensor_parallel import family_problems
from earl_stream.workers.train_step import StepResult, train_step
from earl_stream.workers.vision_inputs import VisionInputs, vision_parameters

log = logging.getLogger(__name__)


class TrainerRank:
    def __init__(self, supervisor: str, *, rank: int, world_size: int, host: str = "127.0.0.1",
                 collective_timeout_s: float = 300.0) -> None:
        self.rank, self.world_size, self.host = rank, world_size, host
        self.stop = StopFlag(stopping="finishing the step in progress, then writing a checkpoint")
        self._closed = threading.Event()
        secret, key_file = worker_key()  # the worker key (or the cluster secret): security/keys.py
        self.client = P.ControlClient(supervisor, secret=secret, key_file=key_file)
        self.hb_client = P.ControlClient(supervisor, secret=secret, key_file=key_file)  # never waits behind a long call
        self.node = ShardNode(host, secret=secret)
        self.metrics_address = M.start_metrics_server(host)
        reg, self.cfg = register(self.client, P.Role.TRAINER, host=host, rank=rank, shard_address=self.node.address,
                                 metrics_address=self.metrics_address)
        self.worker_id = reg.worker_id
        pin_to_cpus(self.cfg.trainer.cpus, self.cfg.trainer.threads)
        torch.manual_seed(self.cfg.seed)
        t = self.cfg.trainer
        device = resolve_device(t.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                                local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if device.type == "cpu" and t.malloc_mmap_threshold:
            applied = set_malloc_mmap_threshold(t.malloc_mmap_threshold)
            log.info("allocations of %d bytes and more %s", t.malloc_mmap_threshold,
                     "are mapped on their own and unmapped when freed" if applied else
                     "stay in the C library's heap (trainer.malloc_mmap_threshold needs glibc's mallopt)")
        self.peak_memory = PeakMemory(device)  # before the model: its CPU baseline is the bare process
        policy = load_policy(model_path(self.cfg))
        self.model, self.tokenizer = policy.model, policy.tokenizer
        # a vision-language policy: its samples' pictures are pulled and fed to its tower (workers.vision_inputs)
        self.vision = VisionInputs(policy.processor, self.model) if policy.processor is not None else None
        if self.vision is not None and self.cfg.model.freeze_vision:
            for p in vision_parameters(self.model):
                p.requires_grad_(False)
        if t.packing and (problems := family_problems(self.model.config, packing=True)):
            raise ConfigError(f"trainer.packing=true: {'; '.join(problems)}; set trainer.packing=false")
        self.lora = LoraSpec.from_config(self.cfg.model.lora)
        if self.lora is not None:  # adapters on a frozen base: only they train, move and are checkpointed
            apply_lora(self.model, self.lora, seed=self.cfg.seed)
        self.model.to(device).train()  # type: ignore[arg-type]
        log.info("trainer rank %d computes on %s (%s)", rank, device, t.dtype)
        self.ref_model = None
        if self.cfg.algo.kl_coef > 0:
            self.ref_model = load_policy(model_path(self.cfg)).model
            self.ref_model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]
        self.optimizer = self._make_optimizer(self.model)
        # every rank starts replicated (plain data parallel) until the first plan re-lays the model
        self.mesh = TrainerMesh(world_size, rank, device)
        self.placement = self.mesh.placement(RankPlan(dp=world_size, micro_batch_tokens=t.micro_batch_tokens,
                                                      dtype=t.dtype))
        self.peers = all_gather_str(self.node.address, world_size)  # every rank's shard node, in rank order
        self.store_client: ShardClient | CentralClient = ShardClient(secret=secret, transport=self.cfg.store.transport)
        self.dispatcher = None
        if self.cfg.store.dispatch == "central":  # the single-controller pattern, kept for measurement
            if rank == 0:
                self.dispatcher = start_dispatcher_process(host, secret=secret)
            address = broadcast_str(self.dispatcher.address if self.dispatcher else "", world_size)
            self.store_client = CentralClient(self.store_client, address)
        self.step_cfg = self.cfg.trainer  # the trainer knobs a plan may change at a step boundary
        self.plan_version = 0
        self.unreleased: list[tuple[int, list[str]]] = []  # (step, lost ids) trained, released at a checkpoint
        self.phase = "start-up"  # what a failed collective was part of, for its error message
        self.version = self._resume(reg.policy_version)
        self.checkpointed_step = self.version  # the version the newest checkpoint holds (0: none)
        self.published_version = -1
        self.oom = OomRetry(self, collective_timeout_s=collective_timeout_s)
        cap_address_space()  # tests and benchmarks only: a real allocation failure on a CPU rank
        self._hb = threading.Thread(target=self._heartbeat_loop, daemon=True)
        self._hb.start()

    def run(self) -> int:
        cfg, t = self.cfg, self.cfg.trainer
        step = self.version
        end = cfg.steps or float("inf")
        if self.rank == 0:
            self._release_checkpointed()  # releases a checkpoint we resumed from still owed the supervisor
        self._publish(self.version, {})  # rollout pulls its first weights from the trainer
        stopped = False
        while step < end:
            self.phase = f"step {step}"
            metas = self._claim(step)
            if metas is None:  # every rank agreed to stop while waiting for the step's samples
                stopped = True
                break
            result = self._train(step, metas)
            if result is None:  # abandoned on an allocation failure and re-planned: claim it again, the same rows
                continue
            peak = max_over_ranks(self.peak_memory.step_peak(), self.world_size)  # the fullest rank's, collective
            step += 1
            self.version = step
            lost = result.lost_sample_ids  # every rank's: train_step agrees on them before training
            if self.rank == 0:
                self.unreleased.append((step - 1, lost))
            self._report(result)
            self._observe_staleness(step, metas)
            if any_rank([bool(self.stop)], self.world_size)[0]:  # asked during the step: it is done, stop here
                stopped = True
                break
            if step % t.checkpoint_every == 0:
                self.save_checkpoint(step)  # every rank: DCP writes collectively
            # collective: every rank has pulled, so producers may free
            self._publish(step, {**result.metrics(), "peak_memory_bytes": float(peak),
                                 "peak_memory_allocated": float(self.peak_memory.device.type == "cuda")})
            if self.rank == 0:
                self._call(P.Release(worker_id=self.worker_id, step=step - 1, lost_sample_ids=lost, checkpointed=False))
                if step % t.checkpoint_every == 0:
                    self._release_checkpointed()
        self._finish(step, stopped)
        return 0

    def _train(self, step: int, metas: list) -> StepResult | None:
        """This rank's part of step `step`; None when a rank failed to allocate and the step is to be claimed
        again under the plan the supervisor answered with (`trainer.oom_recovery`)."""
        cfg, t = self.cfg, self.cfg.trainer
        if isinstance(self.store_client, CentralClient):
            self.store_client.set_step(step, metas)
        self.peak_memory.start()

        def run() -> StepResult:
            return train_step(self.model, self.optimizer, metas, self.placement.layout, self.store_client,
                              self.step_cfg, algo=cfg.algo, step=step, run_steps=cfg.steps,
                              min_version=max(0, step - t.max_staleness), ref_model=self.ref_model, rank=self.rank,
                              placement=self.placement, temperature=cfg.rollout.temperature, vision=self.vision)

        return self.oom.train(step, metas, run) if t.oom_recovery else run()

    def _finish(self, step: int, stopped: bool) -> None:
        """After the last step (the run's end, or a stop every rank agreed on at this same step): the
        checkpoint of `step` unless one holds it already, written by every rank together, then (rank 0) the
        releases it holds, and the end of the run if it is done. Nothing new is published."""
        fresh = step > self.checkpointed_step
        if fresh:
            self.save_checkpoint(step)
        if stopped:
            log.info("trainer rank %d: stopping after step %d, %s", self.rank, step,
                     f"checkpoint written at version {step}" if fresh else
                     f"the checkpoint of version {step} was already written" if step else "nothing trained to checkpoint")
        done = bool(self.cfg.steps) and step >= self.cfg.steps
        if done and not stopped:  # the final version's evaluation round, played on the weights just saved
            await_final_eval(step, self.cfg.eval, rank=self.rank, world_size=self.world_size, worker_id=self.worker_id,
                             call=self._call, stop=self.stop)
        if self.rank == 0:
            self._release_checkpointed()
            if done:
                self._call(P.Finished(worker_id=self.worker_id, reason=f"{step} steps done"))
        self.close()

    def _claim(self, step: int) -> list | None:
        """The step's metadata once every rank has it, or None when the pool agreed to stop first.

        Each wait ends in one all-reduce of (asked to stop, still waiting, out of time), so the ranks
        take every branch together; a claim is the same for every rank and asking again is idempotent.
        """
        t = self.cfg.trainer
        deadline = time.monotonic() + t.claim_timeout_s
        msg = P.Claim(worker_id=self.worker_id, step=step, num_groups=t.groups_per_step,
                      min_policy_version=max(0, step - t.max_staleness))
        reply: P.Claimed | None = None
        while True:
            if not self.stop and (reply is None or not reply.ready):
                reply = self.client.call_retry(msg, deadline_s=t.claim_timeout_s, what=f"claim of step {step}")
            ready = reply is not None and reply.ready
            stop, waiting, late = any_rank([bool(self.stop), not ready, time.monotonic() > deadline], self.world_size)
            if stop:
                return None
            if not waiting:
                assert reply is not None
                self._apply_plan(reply.plan, step)
                return table_to_metas(table_from_ipc(reply.table_ipc))
            if late:
                raise ControlPlaneTimeout(f"step {step}: fewer than {t.groups_per_step} complete prompt groups "
                                          f"arrived within trainer.claim_timeout_s={t.claim_timeout_s:.0f}s; "
                                          f"{(reply.waiting if reply else '') or 'are rollout workers running?'}")
            self.stop.wait(0.02)

    def _apply_plan(self, wire: P.TrainerPlan | None, step: int) -> None:
        """Adopt the selector's plan at this step boundary; every rank adopts rank 0's, together.

        A plan that moves the parameters (FSDP's mesh or the tp degree) re-lays model and optimizer
        state onto the new mesh shard to shard, `trainer.reshard_bucket_bytes` of whole tensors at a
        time (`sharding.relayout`: the old model and optimizer are spent, never a full replica); sp,
        micro-batch budget and recomputation change only how the step is cut and what is kept for the
        backward pass. The math does not change:
        the loss is normalised by the claim's token count and gradients are summed over the pool.
        """
        if self.world_size > 1:
            raw = broadcast_bytes(msgspec.json.encode(wire) if wire is not None else b"")
            wire = msgspec.json.decode(raw, type=P.TrainerPlan) if raw else None
        if wire is None or wire.version == self.plan_version:
            return
        self.plan_version = wire.version
        plan = RankPlan.from_wire(wire, dtype=self.cfg.trainer.dtype)
        problems = plan.problems(self.world_size, self.model.config)
        if self.lora is not None and plan.tp > 1:
            problems.append("LoRA adapters are not laid out for tensor parallelism (model.lora)")
        if problems:
            log.error("step %d: refusing trainer plan v%d (%s): %s; keeping %s", step, wire.version, plan.name,
                      "; ".join(problems), self.placement.plan.name)
            return
        self.phase = f"re-shard to plan v{wire.version} ({plan.name}) before step {step}"
        placement = self.mesh.placement(plan)
        if plan.model_layout != self.placement.plan.model_layout:
            log.info("step %d: re-laying the model from %s to %s", step, self.placement.plan.name, plan.name)
            start = time.monotonic()
            bucket = self.cfg.trainer.reshard_bucket_bytes
            relaid = relayout(self.model, self.optimizer, placement, self._make_optimizer, bucket_bytes=bucket)
            self.model, self.optimizer = relaid.model, relaid.optimizer or self.optimizer
            if self.ref_model is not None:
                self.ref_model = relayout(self.ref_model, None, placement, self._make_optimizer,
                                          bucket_bytes=bucket).model
            buckets = relaid.buckets
            del relaid
            free_unused_memory()  # the replaced model and optimizer, before the next step needs the room
            log.info("step %d: re-laid the model from %s to %s in %.2fs (%d buckets of <= %d MiB)", step,
                     self.placement.plan.name, plan.name, time.monotonic() - start, buckets, bucket >> 20)
        apply_plan(self.model, placement, extra_models=[self.ref_model] if self.ref_model is not None else [])
        self.placement = placement
        self.step_cfg = dataclasses.replace(self.step_cfg, micro_batch_tokens=plan.micro_batch_tokens)
        log.info("step %d: adopted trainer plan v%d: %s (data ranks %d, tp %d, sp %d), micro-batch %d tokens, "
                 "recompute %s, %s (%s)", step, wire.version, plan.name, plan.data_ranks, plan.tp, plan.sp,
                 plan.micro_batch_tokens, plan.recompute, plan.dtype, wire.reason)
        if self.rank == 0:
            self._call(P.PlanAdopted(worker_id=self.worker_id, version=wire.version, step=step))

    def _make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        t = self.cfg.trainer
        # a frozen base (LoRA) gets no optimizer state: AdamW sees the trainable parameters only
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)

    def _release_checkpointed(self) -> None:
        """Release the steps the latest checkpoint holds (rank 0, right after writing it).

        Each step is reported trained at once (checkpointed=False) but released only once a
        checkpoint holds its update: a pool that dies and resumes from that checkpoint is served
        the later steps' claims again, with the same rows, so no prompt is skipped and none is
        trained twice. The producers keep those rows until then (at most `trainer.checkpoint_every`
        steps).
        """
        for done, lost in self.unreleased:
            self._call(P.Release(worker_id=self.worker_id, step=done, lost_sample_ids=lost))
        self.unreleased = []

    def _publish(self, version: int, metrics: dict[str, float]) -> None:
        """Every rank publishes its own shard of the weights (no gather); rank 0's manifest names the
        other ranks that hold pieces, and rank 0 announces the version. Collective."""
        state = adapter_state(self.model) if self.lora is not None else self.model.state_dict()
        pieces = shard_pieces(state, self.placement)
        M.STORE_WEIGHT_VERSION_BYTES.labels(str(self.rank)).set(state_bytes(state))
        metrics = {**metrics, "weight_bytes_per_version": float(state_bytes(state))}
        holders = all_gather_flags(bool(pieces), self.world_size)
        peers = [a for r, a in enumerate(self.peers) if holders[r] and r != self.rank]
        publish_weights(self.node, version, pieces, peers=peers if self.rank == 0 else [])
        self.published_version = version
        if version >= P.WEIGHT_VERSIONS_KEPT:
            drop_weights(self.node, version - P.WEIGHT_VERSIONS_KEPT)
        if self.world_size > 1:
            dist.barrier()  # every rank's pieces are in its node before the version is announced
        if self.rank == 0:
            self._call(P.PublishVersion(worker_id=self.worker_id, version=version,
                                        weights_address=self.node.address, metrics=metrics))

    def _call(self, msg: P.Msg) -> P.Msg | None:
        """A call that survives a supervisor restart (the messages it is used for are idempotent)."""
        return self.client.call_retry(msg, deadline_s=self.cfg.trainer.claim_timeout_s, what=type(msg).__name__)

    def _observe_staleness(self, step: int, metas: list) -> None:
        """Versions between the oldest token of each trained sample and the policy it trained (step - 1)."""
        if self.rank != 0:
            return  # every rank sees the same claim: count each sample once
        for m in metas:
            if m.policy_version_min >= 0:
                M.TRAINER_STALENESS.labels(str(self.rank)).observe(max(0, step - 1 - m.policy_version_min))

    def _report(self, r: StepResult) -> None:
        rank = str(self.rank)
        M.TRAINER_REWARD.labels(rank).set(r.mean_reward)
        M.TRAINER_STEP_SECONDS.labels(rank).observe(r.step_seconds)
        M.TRAINER_LOSS.labels(rank).set(r.loss)
        M.TRAINER_GRAD_NORM.labels(rank).set(r.grad_norm)
        M.TRAINER_MISMATCH.labels(rank).set(r.mismatch)
        M.TRAINER_ROUTING_MISMATCH.labels(rank).set(r.routing_mismatch)
        M.TRAINER_MASKED.labels(rank).set(r.masked_frac)
        M.TRAINER_CLIP_FRAC.labels(rank).set(r.clip_frac)
        M.TRAINER_STEPS.labels(rank).inc()
        M.STORE_PULL_SECONDS.labels(rank).observe(r.pull_seconds)
        M.STORE_PULL_BYTES.labels(rank).inc(r.pull_bytes)
        M.STORE_STEP_PULL_BYTES.labels(rank).set(r.pull_bytes)
        log.info("step %d: loss %.4f grad-norm %.3f reward %.3f (%d samples, %d tokens) in %.2fs (pull %.3fs); "
                 "clipped %.4f |ratio-1| %.4f masked %.4f (stale %.4f); %d loss tokens", self.version, r.loss,
                 r.grad_norm, r.mean_reward, r.samples, r.tokens, r.step_seconds, r.pull_seconds, r.clip_frac,
                 r.ratio_dev, r.masked_frac, r.stale_frac, r.loss_tokens)
        if r.images:
            log.info("step %d: %d images pulled (%d bytes of PNG, of the step's %d)", self.version, r.images,
                     r.image_bytes, r.claim_image_bytes)

    def _heartbeat_loop(self) -> None:
        # beats on while the rank finishes its last step after a stop, until it closes
        while not self._closed.wait(self.cfg.supervisor.heartbeat_s):
            try:
                # rank 0 reports the version its node's manifest serves; the other ranks' nodes hold pieces only
                published = self.published_version if self.rank == 0 else -1
                reply = self.hb_client.call(P.Heartbeat(worker_id=self.worker_id, stats={"published_version": published}))
                if not reply.known:  # the supervisor restarted without us, or declared us dead
                    register(self.hb_client, P.Role.TRAINER, host=self.host, rank=self.rank,
                             shard_address=self.node.address, metrics_address=self.metrics_address,
                             worker_id=self.worker_id)
                    continue
            except EarlError as exc:
                log.warning("heartbeat failed: %s", exc)
                continue
            if reply.stop:
                self.stop.set()

    def _resume(self, supervisor_version: int) -> int:
        """Continue from the latest checkpoint when the run is already under way (version > 0).

        Every rank loads the checkpoint rank 0 names, together: DCP reshards, so the pool may have a
        different size from the one that wrote it.
        """
        found = ckpt.latest_checkpoint(self.cfg.run_dir) if supervisor_version > 0 and self.rank == 0 else None
        name = broadcast_str(found.name if found else "", self.world_size)
        if not name:
            return 0
        path = ckpt.checkpoints_dir(self.cfg.run_dir) / name
        self.phase = f"loading checkpoint {path}"
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, collective=self.world_size > 1)
        torch.set_rng_state(state.rng)
        self.unreleased = state.unreleased
        log.info("resumed from %s at step %d (the supervisor was at version %d)", path, state.step, supervisor_version)
        return state.step

    def save_checkpoint(self, step: int) -> Path:
        """Write the checkpoint of `step` (`checkpoint.save_checkpoint`): every rank together."""
        self.phase = f"checkpoint of step {step}"
        state = ckpt.RunState(step=step, policy_version=self.version, rng=torch.get_rng_state(),
                              unreleased=list(self.unreleased), world_size=self.world_size)
        # a vision-language policy's processor (tokenizer, image processor): the checkpoint loads as a policy again
        files = self.vision.chat.processor if self.vision is not None else self.tokenizer
        out = ckpt.save_checkpoint(self.cfg.run_dir, state, self.model, self.optimizer, files,
                                   rank=self.rank, collective=self.world_size > 1)
        self.checkpointed_step = step
        return out

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.stop.set()
        # the heartbeat thread may be inside a call (or about to re-register): let it leave before its client is
        # closed, else it opens a fresh socket that the interpreter's exit tears down under it (an abort at exit)
        if self._hb is not threading.current_thread():
            self._hb.join(self.hb_client.timeout_s + 1)
        self.node.close()
        self.store_client.close()
        if self.dispatcher is not None:
            self.dispatcher.stop()
        self.client.close()
        self.hb_client.close()


class CollectiveFailed(EarlError):
    """A collective with the other trainer ranks failed or timed out (a rank died or hangs)."""


def run_trainer_rank(supervisor: str, host: str = "127.0.0.1", *, collective_timeout_s: float = 300.0) -> int:
    """One rank; under torchrun (or `worker --nproc`) RANK/WORLD_SIZE/MASTER_* come from the environment.

    Every collective (and joining the pool) gives up after `collective_timeout_s` with a
    CollectiveFailed naming the step it was part of, so a dead or frozen rank stops the pool
    instead of hanging it; relaunching the pool resumes it from the latest checkpoint.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer: TrainerRank | None = None
    try:
        if world_size > 1:
            dist.init_process_group(pool_backend(), init_method=os.environ.get(RENDEZVOUS_ENV), rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=collective_timeout_s))
        trainer = TrainerRank(supervisor, rank=rank, world_size=world_size, host=host,
                              collective_timeout_s=collective_timeout_s)
        return trainer.run()
    except RuntimeError as exc:
        if world_size == 1 or not (isinstance(exc, dist.DistError) or "gloo" in str(exc)):
            raise
        phase = trainer.phase if trainer is not None else "joining the pool"
        where = os.environ.get(RENDEZVOUS_ENV) or f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise CollectiveFailed(
            f"trainer rank {rank} of {world_size}: a collective with the other ranks ({phase}; rendezvous at "
            f"{where}) failed or waited longer than {collective_timeout_s:.0f}s: another rank died or hangs "
            f"({str(exc).splitlines()[0][:200]}). Relaunch the pool (or start it with --restart N) to resume "
            "from the latest checkpoint.") from None
    finally:
        if trainer is not None:  # run() has closed it when it returned
            trainer.close()
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
