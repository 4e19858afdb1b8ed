"""Evaluation rounds in the supervisor's state machine (supervisor/eval_rounds.py): due at multiples of
eval.every, handed out between training groups on at most eval.share of a worker's slots, never in the
ledger, finished into success / pass@k points; requeued when a worker dies; the final version's round played by
every slot while the trainer waits; a game without held-out items played on evaluation seeds; refused
environments."""

from __future__ import annotations

from pathlib import Path

import pytest

from earl_stream import protocol as P
from earl_stream.config import load_config
from earl_stream.errors import ConfigError
from earl_stream.supervisor.server import Supervisor

PARITY = f"{Path(__file__).resolve().parents[1] / 'evaluation' / 'parity_env.py'}:ParityEnv"


def _sup(*overrides: str) -> Supervisor:
    cfg = load_config(None, [f"envs.0.spec={PARITY}", "envs.0.name=parity", "eval.every=2", "eval.problems=3",
                             "eval.samples=2", "eval.temperature=1", "trainer.group_size=4",
                             "rollout.groups_in_flight=4", "model.path=/nonexistent", *overrides])
    sup = Supervisor(cfg)
    sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:9"), 0.0)
    return sup


def _ask(sup: Supervisor, rid: str, worker: str = "rollout-0") -> P.Prompts:
    reply = sup.handle(P.RequestPrompts(worker_id=worker, max_groups=1, request_id=rid), 0.0)
    assert isinstance(reply, P.Prompts)
    return reply


def _results(tasks: list[P.EvalTask], ok: set[tuple[int, int]]) -> list[P.EvalResult]:
    return [P.EvalResult(task_id=t.task_id, reward=float((t.item, t.sample) in ok), success=(t.item, t.sample) in ok,
                         outcome="correct" if (t.item, t.sample) in ok else "wrong", tokens=3, policy_version=t.version)
            for t in tasks]


def test_a_round_is_played_between_training_groups_and_never_enters_the_ledger() -> None:
    sup = _sup()
    first, second, third = _ask(sup, "0.0"), _ask(sup, "1.0"), _ask(sup, "2.0")
    # 3 items x 2 samples = 6 tasks: a batch of group_size (4), then the 2 left; share 0.5 x 4 slots = 2 batches
    assert [len(r.eval_tasks) for r in (first, second)] == [4, 2] and not first.prompts and not second.prompts
    assert {t.version for t in first.eval_tasks} == {0} and all(t.task_id.startswith("e0.parity.") for t in first.eval_tasks)
    assert not third.eval_tasks and len(third.prompts) == 1  # the other slots keep training
    assert _ask(sup, "0.0").eval_tasks == first.eval_tasks  # a retried request gets the same tasks
    c = sup.ledger.counters
    assert (c.prompts_issued, c.samples_produced) == (1, 0) and sup.ledger.next_ordinal == 1
    tasks = first.eval_tasks + second.eval_tasks
    assert sup.status(0.0)["eval"]["parity"]["in_progress"] == {"version": 0, "done": 0, "total": 6}
    # item 0: 2 of 2 right, item 1: 1 of 2, item 2: 0 of 2
    sup.handle(P.PutEval(worker_id="rollout-0", results=_results(tasks, {(0, 0), (0, 1), (1, 1)})), 0.0)
    point = sup.status(0.0)["eval"]["parity"]
    assert point["version"] == 0 and point["value"] == pytest.approx(3 / 6)
    assert point["pass_at_k"] == pytest.approx({"1": 0.5, "2": (1 + 1 + 0) / 3})
    assert point["mean_reward"] == pytest.approx(0.5) and point["in_progress"] is None
    assert sup.ledger.counters.samples_produced == 0 and sup.ledger.samples_waiting() == 0
    sup.export_metrics(0.0)
    from earl_stream import metrics as M

    assert M.EVAL_SUCCESS.labels("parity")._value.get() == pytest.approx(0.5)
    assert M.EVAL_PASS_AT_K.labels("parity", "2")._value.get() == pytest.approx(2 / 3)
    # the next round at version 2 (not 1)
    sup.handle(P.PublishVersion(version=1, weights_address="x"), 0.0)
    assert not _ask(sup, "3.0").eval_tasks
    sup.handle(P.PublishVersion(version=2, weights_address="x"), 0.0)
    assert {t.version for t in _ask(sup, "4.0").eval_tasks} == {2}


def test_tasks_of_a_dead_worker_are_played_again_and_a_busy_round_skips_the_next() -> None:
    sup = _sup("eval.share=0")  # at least one slot
    sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=2, shard_address="127.0.0.1:8"), 0.0)
    held = _ask(sup, "0.0").eval_tasks
    assert len(held) == 4 and not _ask(sup, "1.0").eval_tasks  # one eval batch at a time on this worker
    sup.declare_dead(sup.workers["rollout-0"], "test")
    again = _ask(sup, "0.0", worker="rollout-1").eval_tasks
    assert [t.task_id for t in again] == [t.task_id for t in held]
    sup.handle(P.PutEval(worker_id="rollout-0", results=_results(held, set())), 0.0)  # a dead worker's: ignored
    sup.handle(P.PublishVersion(version=2, weights_address="x"), 0.0)
    sup.handle(P.PutEval(worker_id="rollout-1", results=_results(again, set())), 0.0)
    rest = _ask(sup, "1.0", worker="rollout-1").eval_tasks
    assert {t.version for t in rest} == {0} and len(rest) == 2  # version 2's round waits for version 0's
    sup.handle(P.PutEval(worker_id="rollout-1", results=_results(rest, set())), 0.0)
    status = sup.status(0.0)["eval"]["parity"]
    assert status["version"] == 0 and status["value"] == 0.0 and 2 in status["skipped_versions"]
    # the state survives a snapshot
    restored = Supervisor(sup.cfg)
    restored.restore(sup.snapshot(), 0.0)
    assert restored.status(0.0)["eval"]["parity"]["history"] == status["history"]


def test_the_final_version_is_evaluated_by_every_slot_while_the_trainer_waits() -> None:
    """steps=3, every=2: version 3 is not a multiple, yet its round is decided (beside an unfinished one, not
    skipped); once the trainer published it, requests get only evaluation, on every slot, and `EvalPending`
    tells the trainer when the rounds are played. eval.final_timeout_s=0: no final round."""
    sup = _sup("steps=3", "eval.share=0")
    held = _ask(sup, "0.0").eval_tasks  # version 0's round: 4 of its 6 tasks, on this worker's one eval slot
    assert len(held) == 4 and not _ask(sup, "1.0").eval_tasks
    sup.handle(P.PublishVersion(version=3, weights_address="x"), 0.0)
    pending = sup.handle(P.EvalPending(worker_id="rollout-0"), 0.0)
    assert pending == P.EvalPendingReply(pending=True, version=0, done=0, total=6)
    assert [r.version for r in sup.evals.state.rounds] == [0, 3] and 3 not in sup.evals.state.skipped
    issued = sup.ledger.counters.prompts_issued
    batches = [_ask(sup, f"{i}.1").eval_tasks for i in range(5)]  # the cap is off: every request gets a batch
    assert [len(b) for b in batches] == [2, 4, 2, 0, 0] and sup.ledger.counters.prompts_issued == issued
    assert [{t.version for t in b} for b in batches[:3]] == [{0}, {3}, {3}]
    sup.handle(P.PutEval(worker_id="rollout-0", results=_results(held + batches[0], set())), 0.0)
    assert sup.handle(P.EvalPending(), 0.0) == P.EvalPendingReply(pending=True, version=3, done=0, total=6)
    sup.handle(P.PutEval(worker_id="rollout-0", results=_results(batches[1] + batches[2], {(0, 0)})), 0.0)
    assert sup.handle(P.EvalPending(), 0.0) == P.EvalPendingReply(pending=False)
    assert [p["version"] for p in sup.status(0.0)["eval"]["parity"]["history"]] == [0, 3]
    assert not _ask(sup, "9.0").prompts  # training is over: no training groups either
    off = _sup("steps=3", "eval.final_timeout_s=0")
    assert _ask(off, "0.0").eval_tasks  # version 0's round
    off.handle(P.PublishVersion(version=3, weights_address="x"), 0.0)
    assert off.handle(P.EvalPending(), 0.0) == P.EvalPendingReply(pending=True, version=0, done=0, total=6)
    assert [r.version for r in off.evals.state.rounds] == [0]
    assert _ask(off, "1.0").eval_tasks and _ask(off, "2.0").prompts  # its 2 eval slots, then training goes on


def test_the_last_step_record_waits_for_the_final_round_across_a_restart(tmp_path: Path) -> None:
    """metrics.jsonl's record of the last step is held until the final round finished, then written with it, also
    by a supervisor restored from a snapshot taken in between (the publish is not replayed then)."""
    from earl_stream.supervisor.metrics_log import MetricsLog, read_records

    sup = _sup("steps=2")
    sup.metrics_log = MetricsLog(tmp_path)
    first = _ask(sup, "0.0").eval_tasks + _ask(sup, "1.0").eval_tasks
    sup.handle(P.PutEval(worker_id="rollout-0", results=_results(first, set())), 0.0)
    sup.handle(P.PublishVersion(version=1, weights_address="x", metrics={"loss": 0.5}), 0.0)
    sup.handle(P.PublishVersion(version=2, weights_address="x", metrics={"loss": 0.25}), 0.0)
    assert [r["step"] for r in read_records(tmp_path)] == [1]  # step 2's waits for version 2's round
    restored = _sup("steps=2")
    restored.metrics_log = MetricsLog(tmp_path)
    restored.restore(sup.snapshot(), 0.0)
    restored.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, worker_id="rollout-0"), 0.0)
    final = _ask(restored, "2.0").eval_tasks + _ask(restored, "3.0").eval_tasks
    assert {t.version for t in final} == {2} and len(final) == 6
    restored.handle(P.PutEval(worker_id="rollout-0", results=_results(final, {(0, 0)})), 0.0)
    records = read_records(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] == 0.25
    assert [p["version"] for r in records for p in (r["eval"] or {}).get("parity", [])] == [0, 2]


def test_a_game_without_held_out_items_is_evaluated_on_seeds_training_never_issues() -> None:
    """The embedded default (Tic-Tac-Toe defines no held_out()) with eval.every: its tasks reset the game with
    evaluation seeds, disjoint from every seed the ledger hands out, and its points carry win/draw/loss rates."""
    from earl_stream.env.seeds import EVAL_SEEDS, TRAIN_SEEDS

    sup = Supervisor(load_config(None, ["eval.every=2", "eval.problems=4", "trainer.group_size=4",
                                        "rollout.groups_in_flight=4", "model.path=/nonexistent"]))
    sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=1, shard_address="127.0.0.1:9"), 0.0)
    assert sup.status(0.0)["seed_split"] == {"train": [0, 1 << 30], "eval": [1 << 30, 1 << 31]}
    tasks = _ask(sup, "0.0").eval_tasks
    assert [t.seed for t in tasks] == list(EVAL_SEEDS[:4]) and {t.env for t in tasks} == {"tictactoe"}
    training = [p.seed for i in range(1, 40) for p in _ask(sup, f"{i}.0").prompts]
    assert training and all(s in TRAIN_SEEDS for s in training)
    outcomes = ["win", "draw", "loss", "illegal"]
    sup.handle(P.PutEval(worker_id="rollout-0", results=[
        P.EvalResult(task_id=t.task_id, reward={"win": 1.0, "draw": 0.0}.get(outcomes[t.item], -1.0),
                     success=t.item == 0, outcome=outcomes[t.item], tokens=1, policy_version=0) for t in tasks]), 0.0)
    point = sup.status(0.0)["eval"]["tictactoe"]
    assert point["items"] == "eval_seeds" and point["value"] == pytest.approx(0.25)
    assert (point["win_rate"], point["draw_rate"], point["loss_rate"]) == pytest.approx((0.25, 0.25, 0.5))
    assert point["history"][-1]["loss_rate"] == pytest.approx(0.5)
    sup.export_metrics(0.0)
    from earl_stream import metrics as M

    assert M.EVAL_OUTCOME_RATE.labels("tictactoe", "loss")._value.get() == pytest.approx(0.5)


def test_eval_config_refuses_what_it_cannot_play() -> None:
    load_config(None, ["eval.every=5"])  # the embedded default's game: evaluation seeds
    load_config(None, [f"envs.0.spec={PARITY.replace(':ParityEnv', ':NoHeldOut')}", "eval.every=5"])
    with pytest.raises(ConfigError, match="cannot be loaded"):
        load_config(None, ["envs.0.spec=no_such_module_xyz:Env", "eval.every=5"])
    with pytest.raises(ConfigError, match="'nope' names none of the run's environments"):
        load_config(None, [f"envs.0.spec={PARITY}", "eval.every=5", "eval.envs=[nope]"])
    with pytest.raises(ConfigError, match="eval.samples=2 at eval.temperature=0"):
        load_config(None, [f"envs.0.spec={PARITY}", "eval.every=5", "eval.samples=2"])
    load_config(None, ["eval.every=0"])  # off: nothing checked


def test_tasks_of_a_worker_that_drained_are_played_by_another() -> None:
    sup = _sup()
    held = _ask(sup, "0.0").eval_tasks
    sup.handle(P.Scale(role=P.Role.ROLLOUT, replicas=0), 0.0)  # drains rollout-0: it leaves at its next heartbeat
    reply = sup.handle(P.Heartbeat(worker_id="rollout-0"), 0.0)
    assert isinstance(reply, P.HeartbeatReply) and reply.drained
    sup.handle(P.Register(role=P.Role.ROLLOUT, host="h", pid=2, shard_address="127.0.0.1:8"), 0.0)
    again = _ask(sup, "0.0", worker="rollout-1").eval_tasks
    assert [t.task_id for t in again] == [t.task_id for t in held]
