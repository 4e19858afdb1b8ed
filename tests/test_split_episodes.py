"""Episodes kept as several samples (`rollout.non_append=split`): an agent that rewrites its history through
the OpenAI endpoint yields one sample per segment. The segments of an episode share its prompt ordinal,
group and reward: the ledger waits for all of them and trains each once, durable experience and recovery
keep them, and the advantage counts the episode once. Under `refuse` the summarising agent's episode fails."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from cluster import wait_for
from earl_stream_envs.calculator_agent import CalculatorAgent

from earl_stream import protocol as P
from earl_stream.algo.advantages import compute_advantages, episode_sums
from earl_stream.config import AlgoConfig, EnvSpec
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.records import TOKEN_FIELDS
from earl_stream.store.durable import Identity, Slot
from earl_stream.store.experience import ExperienceWriter, record_checksum
from earl_stream.store.node import ShardNode
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, episode_key, metas_to_table, table_from_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger, PromptState
from earl_stream.supervisor.recovery import recover
from earl_stream.workers.agent_episode import play_agent_episode
from earl_stream.workers.agent_loop import EpisodeFailed
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine
from earl_stream.workers.train_step import _advantages

OLD, NEW = "127.0.0.1:1", "127.0.0.1:2"
SEGMENTS = (3, 1)  # a group of two episodes: the first split in three, the second not


def _rows(prompt: P.Prompt, producer: str = OLD) -> list[SampleMeta]:
    """The group's rows as a rollout worker sends them: episode e's segments in order, e's reward = e."""
    rows = []
    for e, n in enumerate(SEGMENTS):
        for k in range(n):
            sid = f"{prompt.group_id}-e{e}" + (f"-s{k}" if k else "")
            rows.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=prompt.prompt_ordinal,
                                   episode_id=f"e{e}", group_id=prompt.group_id, env=prompt.env, turns=1,
                                   prompt_tokens=3, response_tokens=2, total_tokens=5, reward=float(e), advantage=None,
                                   policy_version_min=0, policy_version_max=0, producer_id="w",
                                   producer_address=producer, checksum=100 + len(rows), created_at=time.time(),
                                   info_json="{}", segment=k, segments=n))
    return rows


def _ledger() -> Ledger:
    return Ledger([EnvSpec()], seed=0, group_size=len(SEGMENTS), groups_per_step=1, max_staleness=1)


def _adds_up(led: Ledger) -> None:
    c = led.counters
    assert c.samples_produced == (c.samples_consumed + c.samples_lost + c.samples_stale + c.samples_filtered
                                  + led.samples_waiting() + led.samples_claimed())


def test_the_ledger_waits_for_every_segment_and_trains_each_once() -> None:
    led = _ledger()
    prompt = led.issue("w", 1)[0]
    rows = _rows(prompt)
    led.add_rows("w", rows[:1] + rows[3:])  # the first segment of each episode: the group is not complete
    assert led.groups[0].state == PromptState.INFLIGHT and led.claim(0, 1, 0)[0] is None
    led.add_rows("w", rows[2:3])
    assert led.groups[0].state == PromptState.INFLIGHT  # segment 1 of episode 0 is still missing
    led.add_rows("w", rows)  # a retried PutMeta: the rows already here are not counted again
    assert led.groups[0].state == PromptState.READY and led.counters.duplicates_detected == 0
    ipc, _ = led.claim(0, 1, 0)
    assert ipc is not None
    claimed = table_to_metas(table_from_ipc(ipc))
    assert sorted(m.sample_id for m in claimed) == sorted(r.sample_id for r in rows)  # every segment, once
    assert sorted((m.segment, m.segments) for m in claimed) == [(0, 1), (0, 3), (1, 3), (2, 3)]
    assert led.claim(1, 1, 0)[0] is None  # nothing else is ready: no segment is claimed twice
    led.trained(0)
    led.trained(0)  # a repeated report counts nothing twice
    c = led.counters
    assert (c.samples_produced, c.samples_consumed, c.episodes_produced, c.segments_split) == (4, 4, 2, 2)
    _adds_up(led)
    led.release(0)
    assert led.journal[-1]["trained"] == [0] and 0 not in led.groups  # one prompt ordinal, trained once
    _adds_up(led)


def test_a_lost_split_group_is_replayed_or_recovered_whole() -> None:
    led = _ledger()
    prompt = led.issue("w", 1)[0]
    rows = _rows(prompt)
    led.add_rows("w", rows)
    assert led.worker_lost("w", OLD) == {"samples_lost": 4, "prompts_reissued": 1}
    _adds_up(led)
    moved = [msgspec.structs.replace(r, producer_address=NEW, producer_id="w2") for r in rows]
    assert recover(led, moved[:2]) == ([], [r.sample_id for r in moved[:2]])  # part of an episode: refused
    snapshot = led.snapshot()
    again = _ledger()
    again.restore(snapshot)  # a restarted supervisor keeps the segments of the lost rows
    accepted, refused = recover(again, moved)
    assert sorted(accepted) == sorted(r.sample_id for r in rows) and not refused
    assert again.counters.samples_lost == 0 and again.counters.samples_recovered == 4
    ipc, _ = again.claim(0, 1, 0)
    assert ipc is not None and [m.producer_address for m in table_to_metas(table_from_ipc(ipc))] == [NEW] * 4
    _adds_up(again)


def test_durable_experience_keeps_the_segments(tmp_path: Path) -> None:
    """What a resumed run reads back (store/durable.py) is every segment with its segment fields; an older file
    without those columns reads as one sample per episode."""
    prompt = P.Prompt(group_id="g0.0", prompt_ordinal=0, env="e", seed=1, group_size=2)
    samples = []
    for meta in _rows(prompt):
        fields = {name: (np.arange(meta.total_tokens) + meta.segment).astype(dtype) for name, dtype in TOKEN_FIELDS.items()}
        samples.append((msgspec.structs.replace(meta, checksum=record_checksum(fields)), fields))
    me = Identity(run="r", model="m")
    Slot(tmp_path, host="h").write(me, 2, samples)
    _, got = Slot(tmp_path, host="h").load(me)
    assert [m for m, _ in got] == [m for m, _ in samples]
    old = metas_to_table([m for m, _ in samples]).drop_columns(["segment", "segments"])
    assert {(m.segment, m.segments) for m in table_to_metas(old)} == {(0, 1)}


def test_segments_share_their_episodes_reward_and_group_for_the_advantage() -> None:
    rewards = np.array([1.0, 1.0, 1.0, 0.0])  # episode A in three segments, episode B in one, one group
    groups, episodes = ["g"] * 4, ["A", "A", "A", "B"]
    adv = compute_advantages("grpo", rewards, groups, episodes=episodes)
    assert adv[0] == adv[1] == adv[2] > 0 > adv[3] and adv[0] == pytest.approx(-adv[3])  # two episodes: +1, -1
    per_sample = compute_advantages("grpo", rewards, groups)  # what counting each segment as an episode gives
    assert per_sample[0] != pytest.approx(-per_sample[3])
    assert list(compute_advantages("rloo", rewards, groups, episodes=episodes)) == pytest.approx([1, 1, 1, -1])
    assert list(episode_sums(np.array([0.5, 0.25, 0.25, 2.0]), episodes)) == [1.0, 1.0, 1.0, 2.0]
    # the trainer's: keys from the metadata rows (a one-sample episode is its own, even with a shared episode_id)
    prompt = P.Prompt(group_id="g0.0", prompt_ordinal=0, env="e", seed=1, group_size=2)
    metas = _rows(prompt)
    assert len({episode_key(m) for m in metas}) == 2
    got = _advantages(metas, np.array([m.reward for m in metas]), set(), AlgoConfig())
    assert got[0] == got[1] == got[2] < 0 < got[3] and got[0] == pytest.approx(-got[3])


def _endpoint_run(model_dir: Path, non_append: str, agent: CalculatorAgent, seeds: range) -> list:
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)

    async def go() -> list:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=None,
                                  max_context=4096, default_max_tokens=16, non_append=non_append)
        await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        try:
            return list(await asyncio.gather(*[
                play_agent_episode(agent, endpoint, api_key="none", env_name="calc", seed=s, prompt_ordinal=s,
                                   group_id=f"g{s}") for s in seeds], return_exceptions=True))
        finally:
            await endpoint.close()
            await batcher.aclose()

    return asyncio.run(go())


def test_a_summarising_agent_yields_a_sample_per_segment_or_fails_under_refuse(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    agent = CalculatorAgent(max_turns=4, max_tokens=8, summarize_after=2)  # the tiny model never answers: 4 turns
    played = _endpoint_run(tiny_model_dir, "split", agent, range(2))
    for records in played:
        assert not isinstance(records, BaseException), records
        assert [(r.segment, r.segments) for r in records] == [(0, 2), (1, 2)]
        assert len({r.sample_id for r in records}) == 2 and len({r.episode_id for r in records}) == 1
        assert {r.reward for r in records} == {0.0} and [r.turns for r in records] == [2, 2]
        for r in records:
            assert r.info["turns"] == 4 and r.info["prefix_mismatches"] == 1 and r.loss_mask[:r.prompt_tokens].sum() == 0
        # the second segment starts from the summary, not from the first segment's tokens
        assert records[1].input_ids[:records[1].prompt_tokens].tolist() != records[0].input_ids[:records[1].prompt_tokens].tolist()
    node = ShardNode("127.0.0.1", secret=None)
    try:  # the store takes every segment as a sample of its own
        metas = ExperienceWriter(node, "w").put([r for records in played for r in records])
        assert [(m.segment, m.segments) for m in metas] == [(0, 2), (1, 2)] * 2
    finally:
        node.close()
    refused = _endpoint_run(tiny_model_dir, "refuse", agent, range(2))
    for outcome in refused:
        assert isinstance(outcome, EpisodeFailed) and "rollout.non_append=split" in str(outcome), outcome


@pytest.mark.slow
@pytest.mark.faults  # two runs of `up`: 60-120 s here
def test_resume_trains_the_persisted_segments_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`up` with the summarising agent under split, stopped (Ctrl-C) after a checkpoint while samples wait in the
    store; `up --resume` takes the persisted segments back (whole groups), trains them instead of playing their
    prompts again, no prompt is trained twice and the sample ledger adds up, segments included."""
    from test_durable_resume import _adds_up as adds_up
    from test_durable_resume import _no_prompt_twice, _status

    run = tmp_path / "run"
    envs = '[{"spec": "calculator_agent", "params": {"summarize_after": 2, "max_turns": 4, "max_tokens": 8}}]'

    def up(steps: int, resume: bool, interrupt_after: int = 0) -> dict:
        summary = tmp_path / f"summary-{steps}.json"
        cmd = [sys.executable, "-m", "earl_stream", "up", "--steps", str(steps), "--summary", str(summary),
               *(["--resume"] if resume else []), f"model.path={tiny_model_dir}", f"run_dir={run}", f"envs={envs}",
               "trainer.groups_per_step=2", "trainer.group_size=2", "trainer.max_staleness=2",
               "trainer.checkpoint_every=2", "rollout.groups_in_flight=4", "rollout.workers=1",
               "supervisor.heartbeat_s=0.2", "rollout.non_append=split"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            if interrupt_after:
                latest = run / "checkpoints" / "latest"
                wait_for(lambda: latest.exists() and int(latest.read_text().split("_")[1]) >= interrupt_after
                         or proc.poll() is not None, 180, f"a checkpoint of step {interrupt_after}")
                wait_for(lambda: _status(run).get("samples_in_store", 0) >= 4 or proc.poll() is not None, 60,
                         "samples waiting in the store")
                proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, out[-3000:]  # a requested stop (Ctrl-C) exits 0, as the end of the run does
        return dict(json.loads(summary.read_text()))

    first = up(40, resume=False, interrupt_after=2)
    assert first["segments_split"] > 0 and first["samples_produced"] == first["episodes_produced"] + first["segments_split"]
    stopped_at = first["policy_version"]
    second = up(stopped_at + 3, resume=True)
    assert second["samples_recovered"] > 0 and second["duplicates_detected"] == 0, second
    assert second["samples_produced"] == second["episodes_produced"] + second["segments_split"]
    adds_up(second)
    _no_prompt_twice(run, stopped_at + 3)
