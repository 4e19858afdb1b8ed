"""The ledger's side of the algorithm: dynamic sampling drops groups of equal rewards for good (counted,
freed, never replayed) and the step fills with other groups; the staleness bound refuses a group only
when even its newest token is too old (the trainer masks the older tokens of a newer group)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from earl_stream.config import EnvSpec, load_config
from earl_stream.protocol import Prompt
from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, table_from_ipc, table_to_metas
from earl_stream.supervisor.ledger import Ledger
from earl_stream.workers.sync_loop import SyncLoop


def _rows(prompt: Prompt, rewards: list[float], versions: tuple[int, int] = (0, 0)) -> list[SampleMeta]:
    return [SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"{prompt.group_id}-{i}",
                       prompt_ordinal=prompt.prompt_ordinal, episode_id=str(i), group_id=prompt.group_id, env=prompt.env,
                       turns=1, prompt_tokens=3, response_tokens=2, total_tokens=5, reward=r, advantage=None,
                       policy_version_min=versions[0], policy_version_max=versions[1], producer_id="w",
                       producer_address="127.0.0.1:1", checksum=0, created_at=time.time(), info_json="{}")
            for i, r in enumerate(rewards)]


def _accounted(led: Ledger, claimed: int) -> bool:
    c = led.counters
    return c.samples_produced == (c.samples_consumed + c.samples_lost + c.samples_stale + c.samples_filtered
                                  + led.samples_waiting() + claimed)


def test_dynamic_sampling_drops_uniform_groups_and_fills_the_step() -> None:
    led = Ledger([EnvSpec()], seed=0, group_size=2, groups_per_step=2, max_staleness=0, dynamic_sampling=True)
    first = led.issue("w", 2)
    led.add_rows("w", _rows(first[0], [1.0, 1.0]))  # no signal: dropped
    led.add_rows("w", _rows(first[1], [0.0, 1.0]))
    ipc, frees = led.claim(0, 2, min_policy_version=0)
    assert ipc is None and sorted(frees["127.0.0.1:1"]) == [f"{first[0].group_id}-0", f"{first[0].group_id}-1"]
    assert led.counters.samples_filtered == 2 and _accounted(led, 0)
    more = led.issue("w", 2)  # the dropped group's room is handed out again: a new prompt, not a replay
    assert [p.prompt_ordinal for p in more] == [2]
    led.add_rows("w", _rows(more[0], [-1.0, 1.0]))
    ipc, _ = led.claim(0, 2, min_policy_version=0)
    assert ipc is not None
    assert sorted({m.prompt_ordinal for m in table_to_metas(table_from_ipc(ipc))}) == [1, 2]
    assert _accounted(led, 4)
    led.release(0)
    assert led.counters.samples_consumed == 4 and led.counters.samples_filtered == 2 and _accounted(led, 0)


def test_without_dynamic_sampling_uniform_groups_train() -> None:
    led = Ledger([EnvSpec()], seed=0, group_size=2, groups_per_step=1, max_staleness=0)
    (p,) = led.issue("w", 1)
    led.add_rows("w", _rows(p, [1.0, 1.0]))
    assert led.claim(0, 1, min_policy_version=0)[0] is not None and led.counters.samples_filtered == 0


def test_staleness_refuses_a_group_only_when_its_newest_token_is_too_old() -> None:
    led = Ledger([EnvSpec()], seed=0, group_size=2, groups_per_step=2, max_staleness=1)
    spanning, old = led.issue("w", 2)
    led.add_rows("w", _rows(spanning, [0.0, 1.0], versions=(1, 3)))  # an episode across weight updates
    led.add_rows("w", _rows(old, [0.0, 1.0], versions=(1, 2)))
    ipc, _ = led.claim(4, 1, min_policy_version=3)
    assert ipc is not None and led.counters.samples_stale == 2
    assert {m.group_id for m in table_to_metas(table_from_ipc(ipc))} == {spanning.group_id}
    assert [p.prompt_ordinal for p in led.issue("w", 2)][:1] == [old.prompt_ordinal]  # the stale one is replayed


ENV_SOURCE = '''
from earl_stream.env import StepResult


class HalfConstant:
    """One turn. Prompts of even seed give every reply reward 1 (a group with no signal); odd seeds reward
    the parity of the reply's bytes."""

    system_prompt = "Say something."
    max_turn_tokens = 3

    def reset(self, seed):
        self.seed = seed
        return f"Game {seed % 97}."

    def step(self, action_text):
        reward = 1.0 if self.seed % 2 == 0 else float(sum(action_text.encode()) % 2)
        return StepResult("Done.", reward, True, {"outcome": "win" if reward else "loss"})
'''


def test_the_sync_loop_fills_each_step_with_groups_that_carry_signal(tmp_path: Path, tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    (tmp_path / "half.py").write_text(ENV_SOURCE)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}",
                             f"envs.0.spec={tmp_path}/half.py:HalfConstant", "trainer.groups_per_step=2",
                             "trainer.group_size=4", "algo.dynamic_sampling=true", "steps=2"])
    loop = SyncLoop(cfg)
    steps = loop.run()
    assert [s.result.samples for s in steps] == [8, 8]
    assert loop.ledger.counters.samples_filtered > 0  # about half the prompts have an even seed
    assert loop.ledger.counters.samples_consumed == 16
    c = loop.ledger.counters
    assert c.samples_produced == c.samples_consumed + c.samples_filtered + loop.ledger.samples_waiting()
