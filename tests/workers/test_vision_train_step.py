"""A vision-language policy trains on its episodes' pictures: the real `train_step` pulls each
sample's images with its rows (`store.experience.pull_images`), recomputes the vision tower and puts the features
over the image tokens (`workers.vision_inputs`). Its forward equals the model's own (transformers' merger) on the
same tokens and pixels; the step under dp2, fsdp2 and sp2 (slices that cut images, packed micro-batches of several
rows) equals the single-process step within 1e-5 (loss, gradient norm, updated weights); `model.freeze_vision`
leaves the tower as it was; a text-only trainer refuses samples with pictures. Idefics3 (SmolVLM), and Qwen2.5-VL
and Qwen2-VL, whose decoders take 3-D positions (`model.mrope`: under sp2 a rank's slice after a picture it does
not hold is still shifted by it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from earl_stream.env import Observation

REL_TOL = 1e-5
LENGTHS_REPLY = [3, 9, 5, 12, 4, 7, 10, 6]  # reply tokens per turn: rows of uneven length, two groups of four
# (name, dp, fsdp, sp, micro-batch tokens per rank): sp2 at 40 tokens cuts images between the ranks' slices
PLANS = [("dp2", 2, 1, 1, 4096), ("fsdp2", 1, 2, 1, 80), ("sp2", 1, 1, 2, 40)]


def _picture(i: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(100 * i + k)
    return rng.integers(0, 256, (20 + 3 * k, 24 + i, 3), dtype=np.uint8)


def _records(model: Any, chat: Any) -> list[Any]:
    """Two-turn episodes, a picture in each observation, replies of random text tokens; behaviour log-probs near
    the model's own (from transformers' forward with the pixels)."""
    from earl_stream.records import SampleRecord

    rng = np.random.default_rng(0)
    out = []
    for i, reply in enumerate(LENGTHS_REPLY):
        ids, images = chat.first_turn("Look closely. " * (2 + i), Observation(f"Board {i}.", [_picture(i, 0)]))
        mask = [0] * len(ids)
        a = rng.integers(5, 200, reply).tolist() + [chat.end_token_id]
        ids, mask = ids + a, mask + [1] * len(a)
        more, second = chat.next_turn(Observation("Again.", [_picture(i, 1)]))
        images += [type(s)(s.start + len(ids), s.tokens, s.image) for s in second]
        ids, mask = ids + more, mask + [0] * len(more)
        b = rng.integers(5, 200, reply + 2).tolist()
        ids, mask = ids + b, mask + [1] * len(b)
        with torch.no_grad():
            lp = _hf_logprobs(model, chat, ids, images)
        blp = np.concatenate([[0.0], lp + 0.05 * np.sin(np.arange(1, len(ids)))]).astype(np.float32)
        m = np.array(mask, np.uint8)
        out.append(SampleRecord(
            sample_id=f"s{i}", prompt_ordinal=i // 4, episode_id=f"e{i}", group_id=f"g{i // 4}", env="pictures",
            turns=2, prompt_tokens=int(np.argmax(m)), input_ids=np.array(ids, np.int32), loss_mask=m,
            behaviour_logprobs=blp * m, policy_version=np.where(m == 1, 0, -1).astype(np.int32),
            reward=float(i % 3 == 0) + 0.1 * i, images=tuple(images)))
    return out


def _hf_logprobs(model: Any, chat: Any, ids: list[int], images: list[Any]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1 from the model's own forward (its merger puts the pictures in), the image
    token out of the distribution as the engine samples (0 where the label is one: a placeholder, never a choice)."""
    from vlm_inputs import hf_image_kwargs

    x = torch.tensor([ids])
    logits = model(input_ids=x, **hf_image_kwargs(chat, x, [chat.prompt_image(i) for i in images])).logits[0]
    from earl_stream.model.loading import placeholder_token_ids

    never = torch.tensor(placeholder_token_ids(model.config))  # Qwen2.5-VL: its video token too
    logits[:, never] = float("-inf")
    labels = torch.tensor(ids[1:])
    lp = torch.log_softmax(logits[:-1].float(), -1).gather(-1, labels[:, None])[:, 0]
    return lp.masked_fill(torch.isin(labels, never), 0.0).numpy()


def _load(model_dir: str) -> tuple[Any, Any]:
    from earl_stream.model import load_vision_model
    from earl_stream.workers.vision_inputs import VisionInputs

    model, processor = load_vision_model(model_dir)
    return model, VisionInputs(processor, model)


def _claim(model_dir: str) -> tuple[Any, Any, list[Any]]:
    """(a node holding the records, its client, their metas): each process builds the same ones."""
    from earl_stream.store import ExperienceWriter, ShardClient, ShardNode

    model, vision = _load(model_dir)
    records = _records(model, vision.chat)
    node = ShardNode(shm=False)
    return node, ShardClient(timeout_s=30.0), ExperienceWriter(node, "w").put(records)


def _step(model_dir: str, claim: tuple[Any, Any, list[Any]], placement: Any, *, rank: int = 0, freeze: bool = False,
          ) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(loss, grad norm, full weights after) of one SGD(lr=1) step of a fresh model under `placement`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.config import AlgoConfig, TrainerConfig
    from earl_stream.workers.sharding import apply_plan, shard_model
    from earl_stream.workers.train_step import train_step
    from earl_stream.workers.vision_inputs import vision_parameters

    model, vision = _load(model_dir)
    model.train()
    if freeze:
        for p in vision_parameters(model):
            p.requires_grad_(False)
    shard_model(model, placement)
    apply_plan(model, placement)
    _, client, metas = claim
    cfg = TrainerConfig(micro_batch_tokens=placement.plan.micro_batch_tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    res = train_step(model, torch.optim.SGD(params, lr=1.0), metas, placement.layout, client, cfg,
                     algo=AlgoConfig(grad_clip=0.0, entropy_coef=0.01), rank=rank, placement=placement, vision=vision)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return res.loss, res.grad_norm, {k: v.detach().clone() for k, v in full.items()}


def _same(got: tuple[float, float, dict[str, torch.Tensor]], ref: tuple[float, float, dict[str, torch.Tensor]],
          init: dict[str, torch.Tensor], what: str) -> None:
    assert got[0] == pytest.approx(ref[0], rel=REL_TOL), what
    assert got[1] == pytest.approx(ref[1], rel=REL_TOL), what
    scale = max(float((v - init[k]).abs().max()) for k, v in ref[2].items())
    worst = max(float((got[2][k] - v).abs().max()) for k, v in ref[2].items())
    assert scale > 1e-4 and worst <= REL_TOL * scale, f"{what}: weights differ by {worst:.3g} (change {scale:.3g})"


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl", "qwen2_vl"])
def vlm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from earl_stream.model.tiny_vlm import init_vlm_model

    size = 64 if request.param == "idefics3" else 56
    return init_vlm_model(tmp_path_factory.mktemp("vlm") / "m", family=request.param, image_size=size)


def test_the_trainers_forward_with_images_equals_the_models_own(vlm_dir: Path) -> None:
    from earl_stream.workers.vision_inputs import BatchImage
    from earl_stream.workers.vocab_parallel import forward_logprobs

    model, vision = _load(str(vlm_dir))
    record = _records(model, vision.chat)[3]
    ids = torch.from_numpy(record.input_ids.astype(np.int64))[None]
    batch = {"input_ids": ids[:, :-1], "position_ids": torch.arange(ids.shape[1] - 1)[None], "labels": ids[:, 1:]}
    with torch.no_grad():
        with vision.merged(model, [BatchImage(0, 0, i) for i in record.images]):
            _, logp = forward_logprobs(model, batch)
        own = _hf_logprobs(model, vision.chat, record.input_ids.tolist(), list(record.images))
    np.testing.assert_allclose(logp[0].numpy(), own, atol=1e-5)
    # the pictures matter: without them the image tokens' embeddings are the token table's
    with torch.no_grad():
        _, blind = forward_logprobs(model, batch)
    assert float((blind[0] - logp[0]).abs().max()) > 1e-3


def test_a_frozen_vision_tower_stays_and_a_text_only_trainer_refuses_pictures(vlm_dir: Path,
                                                                           tiny_model_dir: Path) -> None:
    from earl_stream.config import TrainerConfig
    from earl_stream.errors import ConfigError
    from earl_stream.model import load_model
    from earl_stream.workers.mesh import Placement
    from earl_stream.workers.train_step import train_step

    torch.set_num_threads(1)
    claim = _claim(str(vlm_dir))
    try:
        init = {k: v.clone() for k, v in _load(str(vlm_dir))[0].state_dict().items()}
        _, _, after = _step(str(vlm_dir), claim, Placement.single(micro_batch_tokens=4096), freeze=True)
        moved = {k for k, v in after.items() if not torch.equal(v, init[k])}
        assert moved and not any(k.startswith(("model.vision_model.", "model.connector.", "model.visual.")) for k in moved)
        text, _ = load_model(tiny_model_dir)
        placement = Placement.single(micro_batch_tokens=4096)
        with pytest.raises(ConfigError, match="showed images but the trainer's model is text-only"):
            train_step(text, torch.optim.SGD(text.parameters(), lr=1.0), claim[2], placement.layout, claim[1],
                       TrainerConfig(), placement=placement)
    finally:
        claim[1].close()
        claim[0].close()


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from earl_stream.workers.mesh import Placement, RankPlan, TrainerMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    claim = _claim(model_dir)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        results: dict[str, Any] = {"single": _step(model_dir, claim, Placement.single(micro_batch_tokens=4096))}
        for name, dp, fsdp, sp, tokens in PLANS:
            placement = mesh.placement(RankPlan(dp=dp, fsdp=fsdp, sp=sp, micro_batch_tokens=tokens))
            results[name] = _step(model_dir, claim, placement, rank=rank)
            dist.barrier()  # every rank has pulled from every node before any closes
        results["init"] = _load(model_dir)[0].state_dict()
        torch.save(results, f"{out}.{rank}")
        dist.barrier()  # no rank closes its node while another may pull from it (an error ends every rank)
    finally:
        claim[1].close()
        claim[0].close()
        dist.destroy_process_group()


def test_dp_fsdp_and_sp_steps_with_images_equal_the_single_process_step(vlm_dir: Path, tmp_path: Path) -> None:
    from spawned_ranks import spawn_ranks

    for rank, results in enumerate(spawn_ranks(_worker, 2, str(vlm_dir), str(tmp_path / "vision"))):
        for name, *_ in PLANS:
            _same(results[name], results["single"], results["init"], f"{name} rank {rank}")
