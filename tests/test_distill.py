"""On-policy distillation (`earl_stream.algo.distill`): the teacher's log-probs of a recorded sample
equal `transformers` on the teacher, the reverse-KL terms by hand, a train step in loss mode adds
exactly the k2 term (padded and packed), the store carries `teacher_logprobs` exactly, and a teacher
with another tokenizer is refused at config load."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch


def _record(ids: list[int], prompt: int):
    from earl_stream.records import SampleRecord

    n = len(ids)
    mask = np.zeros(n, np.uint8)
    mask[prompt:] = 1
    blp = (-np.linspace(0.5, 2.0, n) * mask).astype(np.float32)
    return SampleRecord(sample_id="s", prompt_ordinal=0, episode_id="e", group_id="g", env="t", turns=1,
                        prompt_tokens=prompt, input_ids=np.asarray(ids, np.int32), loss_mask=mask,
                        behaviour_logprobs=blp, policy_version=np.zeros(n, np.int32), reward=1.0)


def test_teacher_logprobs_match_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    from earl_stream.algo.distill import TeacherScorer
    from earl_stream.model.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    scorer = TeacherScorer(str(tiny_model_dir), tok)
    recs = [_record([5, 9, 17, 33, 2, 8, 40], 3), _record([7, 11, 3, 19], 1)]
    scored = scorer.score(recs)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).eval()
    for r, s in zip(recs, scored):
        ids = torch.from_numpy(r.input_ids.astype(np.int64))[None]
        with torch.no_grad():
            lp = torch.log_softmax(hf(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        want = np.concatenate([[0.0], lp.numpy()]) * r.loss_mask
        np.testing.assert_allclose(s.teacher_logprobs, want, atol=1e-5)
        assert s.teacher_logprobs.dtype == np.float32
        by_hand = sum((float(b) - float(t)) for b, t, m in zip(r.behaviour_logprobs, want, r.loss_mask) if m)
        assert s.info["distill_kl"] == pytest.approx(by_hand, rel=1e-5)


def test_reverse_kl_terms_by_hand() -> None:
    from earl_stream.algo.distill import distill_loss, reverse_kl

    student = np.array([0.0, -1.0, -0.5, -2.0])
    teacher = np.array([0.0, -0.5, -1.5, -0.1])
    mask = np.array([0, 1, 1, 0])
    np.testing.assert_allclose(reverse_kl(student, teacher, mask), [0.0, -0.5, 1.0, 0.0])
    logp = torch.tensor(student[None], dtype=torch.float32, requires_grad=True)
    loss, k1 = distill_loss(logp, torch.tensor(teacher[None]), torch.tensor(mask[None]), torch.tensor([0.5]), coef=0.2)
    # 0.2 * 0.5 * (0.5 * 0.25 + 0.5 * 1.0) = 0.0625; gradient coef * w * (s - t) on loss tokens
    assert float(loss.detach()) == pytest.approx(0.0625)
    assert k1 == pytest.approx(0.5)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy()[0], [0.0, 0.2 * 0.5 * -0.5, 0.2 * 0.5 * 1.0, 0.0], atol=1e-7)


def test_reward_mode_penalty_from_metadata() -> None:
    from earl_stream.algo.distill import reward_penalties
    from earl_stream.errors import ModelError

    @dataclasses.dataclass
    class Meta:
        sample_id: str
        info_json: str

    metas = [Meta("a", json.dumps({"distill_kl": 2.0})), Meta("b", json.dumps({"distill_kl": -0.5}))]
    np.testing.assert_allclose(reward_penalties(metas, 0.1), [0.2, -0.05])
    with pytest.raises(ModelError, match="without algo.distill"):
        reward_penalties([Meta("c", "{}")], 0.1)


@pytest.mark.parametrize("packing", [False, True])
def test_loss_mode_adds_the_k2_term(tiny_model_dir: Path, packing: bool) -> None:
    """A train step with distillation in the loss: its distill_kl statistic is the k1 sum by hand, and
    its gradient differs from the plain step's by exactly the k2 term's."""
    from earl_stream.algo.distill import TeacherScorer
    from earl_stream.config import AlgoConfig, DistillConfig, TrainerConfig
    from earl_stream.model.loading import load_model
    from earl_stream.store.experience import InProcessPuller
    from earl_stream.store.layout import Layout
    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key
    from earl_stream.workers.train_step import train_step

    model, tok = load_model(tiny_model_dir)
    teacher = TeacherScorer(str(tiny_model_dir), tok)
    torch.manual_seed(0)
    with torch.no_grad():  # a teacher that differs from the student
        for p in teacher.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(3)
    rows, metas, recs = {}, [], []
    for i, n in enumerate([12, 17, 9, 14]):
        ids = torch.randint(5, model.config.vocab_size, (n,), generator=gen).tolist()
        r = teacher.score([_record(ids, 4)])[0]
        recs.append(r)
        for name, arr in r.token_fields().items():
            rows[sample_key(f"s{i}", name)] = arr
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=f"s{i}", prompt_ordinal=0, episode_id=f"s{i}",
                                group_id="g", env="t", turns=1, prompt_tokens=4, response_tokens=r.response_tokens,
                                total_tokens=n, reward=float(i), advantage=None, policy_version_min=0,
                                policy_version_max=0, producer_id="p", producer_address="local", checksum=0,
                                created_at=0.0, info_json=json.dumps(r.info)))
    cfg = TrainerConfig(packing=packing)
    coef = 0.7

    def grads(distill: DistillConfig) -> tuple[dict[str, torch.Tensor], float]:
        m, _ = load_model(tiny_model_dir)
        m.train()
        algo = AlgoConfig(grad_clip=0.0, is_correction="none", lr_schedule="constant", distill=distill)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        res = train_step(m, opt, metas, Layout(), InProcessPuller(rows), cfg, algo=algo)
        return {k: before[k] - v for k, v in m.state_dict().items()}, res.distill_kl

    plain, _ = grads(DistillConfig())
    with_kl, kl_stat = grads(DistillConfig(teacher=str(tiny_model_dir), coef=coef, mode="loss"))
    tokens = sum(r.response_tokens for r in recs)
    # the statistic: mean over loss tokens of (student - teacher), the student's log-probs being the trainer's
    m2, _ = load_model(tiny_model_dir)
    k1 = 0.0
    m2.train()
    total = 0.0
    for r in recs:
        ids = torch.from_numpy(r.input_ids.astype(np.int64))[None]
        lp = torch.log_softmax(m2(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.from_numpy(r.loss_mask[1:]).float()
        d = lp - torch.from_numpy(r.teacher_logprobs[1:])
        k1 += float((d.detach() * mask).sum())
        total = total + coef * (0.5 * d * d * mask).sum() / tokens
    total.backward()
    assert kl_stat == pytest.approx(k1 / tokens, rel=1e-4)
    for name, p in m2.named_parameters():
        if p.grad is None:
            continue
        diff = with_kl[name] - plain[name]
        torch.testing.assert_close(diff, p.grad, atol=1e-5, rtol=1e-3)


def test_store_carries_teacher_logprobs_exactly(tiny_model_dir: Path) -> None:
    """Through a real shard node and client on loopback: whole rows and token ranges."""
    from earl_stream.store.client import ShardClient
    from earl_stream.store.experience import ExperienceWriter, pull_samples
    from earl_stream.store.node import ShardNode

    secret = b"s" * 32
    node = ShardNode("127.0.0.1", secret=secret)
    try:
        r = _record(list(range(5, 25)), 6)
        tl = np.random.default_rng(0).standard_normal(20).astype(np.float32) * r.loss_mask
        r = dataclasses.replace(r, teacher_logprobs=tl)
        meta = ExperienceWriter(node, "w").put([r])[0]
        client = ShardClient(secret=secret, transport="tcp")
        whole = pull_samples(client, [meta], ("input_ids", "teacher_logprobs"))[0]
        assert whole["teacher_logprobs"].tobytes() == tl.tobytes()
        part = pull_samples(client, [meta], ("teacher_logprobs",), {0: [(3, 9), (12, 20)]})[0]
        assert part["teacher_logprobs"].tobytes() == np.concatenate([tl[3:9], tl[12:20]]).tobytes()
    finally:
        node.close()


def test_teacher_with_another_tokenizer_is_refused_at_config_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    from earl_stream.config import load_config
    from earl_stream.errors import ConfigError

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    cfg_json = json.loads((other / "tokenizer_config.json").read_text())
    cfg_json["eos_token"] = "<|user|>" if cfg_json.get("eos_token") != "<|user|>" else "<|system|>"
    (other / "tokenizer_config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(ConfigError, match="tokenizer differs from the student's"):
        load_config(None, [f"model.path={tiny_model_dir}", f"algo.distill.teacher={other}"])
    load_config(None, [f"model.path={tiny_model_dir}", f"algo.distill.teacher={tiny_model_dir}"])  # same: accepted
