"""The warm start of a vision-language model on a game shown as pictures (`default:tictactoe_image`): synthetic
episodes are the agent loop's rendering with each board picture's span, the SFT step's forward merges the
pictures exactly as a plain Hugging Face forward with pixel_values does, a short run learns and saves, and
`model.path=default:<game>` names the embedded model of that game."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from earl_stream.errors import ConfigError
from earl_stream.model.default import default_model_dir, embedded_game, shows_pictures
from earl_stream.model.loading import load_policy
from earl_stream.model.tiny_vlm import init_vlm_model
from earl_stream.model.warmstart import CAPTION_PROMPT, caption_example, evaluate_game, resolve_game, synthetic_episode, warm_start
from earl_stream.sft.config import SFTConfig
from earl_stream.sft.loop import place_model
from earl_stream.sft.step import sft_step
from earl_stream.workers.vision_inputs import VisionInputs

torch.set_num_threads(1)
GAME = "tictactoe_image"


@pytest.fixture(scope="module", params=["idefics3", "qwen2_5_vl"])
def vlm_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    size = 64 if request.param == "idefics3" else 56
    return init_vlm_model(tmp_path_factory.mktemp("vlm") / "m", family=request.param, image_size=size)


def _policy(path: Path):  # type: ignore[no-untyped-def]
    policy = load_policy(path)
    return policy, VisionInputs(policy.processor, policy.model)


def test_a_synthetic_image_episode_keeps_each_picture_in_its_span(vlm_dir: Path) -> None:
    policy, vision = _policy(vlm_dir)
    chat, tok = vision.chat, policy.tokenizer
    for seed in range(5):
        ex = synthetic_episode(chat, tok, seed, random.Random(seed), resolve_game(GAME))
        ids = ex.input_ids.tolist()
        moves = ex.loss_tokens // 2  # each move: a cell digit and the end-of-turn token
        assert len(ex.images) == moves  # a picture before every move: the first board, then one per reply
        image_tokens = [i for i, t in enumerate(ids) if t == chat.image_token_id]
        covered = [p for img in ex.images for p in range(img.start, img.start + img.tokens)
                   if ids[p] == chat.image_token_id]
        assert covered == image_tokens  # every image token is inside exactly one picture's span, in order
        assert not any(ex.loss_mask[img.start: img.start + img.tokens].any() for img in ex.images)
        trained = [t for t, m in zip(ids, ex.loss_mask.tolist()) if m]
        assert trained[1::2] == [chat.end_token_id] * moves
        assert all(1 <= int(tok.decode([t])) <= 9 for t in trained[0::2])


def test_a_caption_names_the_cells_of_its_picture(vlm_dir: Path) -> None:
    """A caption example: one picture of a position of a random game, and that position's text board as the reply
    (what teaches the tiny model to read a picture)."""
    from earl_stream_envs.board_images import tictactoe_picture

    from earl_stream.env.images import decode_image

    policy, vision = _policy(vlm_dir)
    tok = policy.tokenizer
    for seed in range(5):
        ex = caption_example(vision.chat, tok, seed, random.Random(seed), resolve_game(GAME))
        assert len(ex.images) == 1
        reply = [t for t, m in zip(ex.input_ids.tolist(), ex.loss_mask.tolist()) if m]
        assert reply[-1] == vision.chat.end_token_id
        board = tok.decode(reply[:-1])
        cells = [c if c in "XO" else "" for c in board.split()]
        assert len(cells) == 9 and [c for c in board.split() if c not in "XO"] == \
            [str(i + 1) for i, c in enumerate(cells) if not c]
        # the picture is that board's
        assert decode_image(ex.images[0].image).tobytes() == tictactoe_picture(cells).convert("RGB").tobytes()
        assert CAPTION_PROMPT in tok.decode(ex.input_ids.tolist())


def test_the_sft_forward_merges_pictures_as_the_models_own_forward(vlm_dir: Path) -> None:
    """Two image episodes packed into one micro-batch: the step's loss equals the mean over their move tokens of
    the cross-entropy from the model's own forward with each one's pixels, run on each alone (the image
    placeholders left out of the distribution, as the engine never samples them)."""
    from vlm_inputs import hf_image_kwargs

    from earl_stream.model.loading import placeholder_token_ids

    policy, vision = _policy(vlm_dir)
    model, tok, processor = policy.model, policy.tokenizer, policy.processor
    examples = [synthetic_episode(vision.chat, tok, s, random.Random(s), resolve_game(GAME)) for s in (1, 2)]
    nll_sum, own = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            x = torch.from_numpy(ex.input_ids.astype(np.int64))[None]
            out = model(input_ids=x, **hf_image_kwargs(vision.chat, x, [vision.chat.prompt_image(i) for i in ex.images]))
            logits = out.logits[0, :-1].float()
            logits[:, list(placeholder_token_ids(model.config))] = float("-inf")
            logp = torch.log_softmax(logits, -1)
            labels = torch.from_numpy(ex.input_ids[1:].astype(np.int64))
            mask = torch.from_numpy(ex.loss_mask[1:].astype(np.float32))
            nll = -logp.gather(-1, labels[:, None])[:, 0]
            nll_sum += float(torch.where(mask > 0, nll, 0.0).sum())
            own += int(mask.sum())
    cfg = SFTConfig()
    placement = place_model(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    result = sft_step(model, opt, examples, placement, micro_batch_tokens=1 << 20, vision=vision)
    assert result.loss == pytest.approx(nll_sum / own, abs=1e-5)
    assert processor is not None
    with pytest.raises(ValueError, match="VisionInputs"):
        sft_step(model, opt, examples, placement)


def test_a_short_warm_start_of_a_vision_language_model_learns_and_saves(vlm_dir: Path, tmp_path: Path) -> None:
    import shutil

    path = Path(shutil.copytree(vlm_dir, tmp_path / "m"))
    before = [p.detach().clone() for p in load_policy(path).model.parameters()]
    report = warm_start(path, GAME, seconds=120, seed=0, batch_size=4, max_steps=12, eval_games=4)
    assert report.steps == 12 and report.games_trained == 48  # and as many captions
    assert report.final_loss < report.first_loss
    assert 0.0 <= report.legal_rate <= 1.0 and 0.0 <= report.win_rate <= 1.0
    policy, vision = _policy(path)  # saved whole: the processor beside the trained weights
    assert sum(float((a.detach() - b).abs().sum()) for a, b in zip(policy.model.parameters(), before)) > 0
    first = evaluate_game(policy.model, policy.tokenizer, resolve_game(GAME), games=3, seed=1, vision=vision)
    assert first == evaluate_game(policy.model, policy.tokenizer, resolve_game(GAME), games=3, seed=1, vision=vision)


def test_model_path_names_an_embedded_model_by_its_game(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert embedded_game("") == "tictactoe"
    assert embedded_game("default:tictactoe_image") == "tictactoe_image"
    assert embedded_game("/models/x") is None and embedded_game("org/name") is None
    with pytest.raises(ConfigError, match="names no game"):
        embedded_game("default:")
    assert shows_pictures(GAME) and not shows_pictures("tictactoe")
    monkeypatch.setenv("EARL_STREAM_CACHE", str(tmp_path))
    assert default_model_dir(GAME) == tmp_path / "models" / "tictactoe_image-vlm-warm-v1"
    assert default_model_dir("connect_four") == tmp_path / "models" / "connect_four-warm-v4"


def test_the_embedded_vision_language_model_ships_with_the_package(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`default:tictactoe_image` is copied from the package (no 16-minute warm start on first use): the shipped
    build is the current recipe's, its full 1,350 steps, and it loads with its processor."""
    import json

    from earl_stream.model import default as default_model

    monkeypatch.setenv("EARL_STREAM_CACHE", str(tmp_path))
    name = default_model_dir(GAME).name
    assert default_model.packaged_model(name) is not None, f"{name} is not shipped"
    built = default_model.ensure_default_model(game=GAME)
    meta = json.loads((built / "earl_stream_model.json").read_text())
    assert meta["name"] == name and meta["warm_start"]["steps"] == default_model.DEFAULT_WARM_START_STEPS
    assert meta["warm_start"]["legal_rate"] >= 0.9
    policy, _ = _policy(built)
    assert policy.processor is not None and sum(p.numel() for p in policy.model.parameters()) > 1_000_000
