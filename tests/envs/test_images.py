"""Images in observations: `Observation` checks and converts what an environment shows
(PIL images, uint8 arrays, encoded bytes) into PNG bytes once; a bad image fails its episode with a clear error;
images cross an environment host's messages (a sandbox child, an environment server) byte for byte and are checked
again on arrival; the OpenAI endpoint's `image_url` parts are data URLs, checked the same way; the image board games
play the text games' rules on pictures."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
from pathlib import Path

import msgspec
import numpy as np
import pytest
from earl_stream_envs.board_images import connect_four_picture, tictactoe_picture
from earl_stream_envs.tictactoe import TicTacToe
from PIL import Image as PILImage

from earl_stream.config import EnvSpec
from earl_stream.config.load import load_config
from earl_stream.env import Image, Observation, StepResult, env_reset, env_step, make_env
from earl_stream.env import images as images_mod
from earl_stream.env.host import EnvHost, EnvOpen, EnvOpened, EnvStep, EnvStepped, opened_observation, stepped_result
from earl_stream.env.images import decode_image, image_data_url, image_from_data_url, openai_content
from earl_stream.errors import EnvError
from earl_stream.openai_api.messages import BadRequest, normalize
from earl_stream.workers.env_runner import open_env_runners


def _png(arr: np.ndarray) -> bytes:
    out = io.BytesIO()
    PILImage.fromarray(arr).save(out, format="PNG")
    return out.getvalue()


def test_an_observation_turns_every_kind_of_image_into_the_same_png_pixels() -> None:
    arr = (np.arange(12 * 10 * 3, dtype=np.uint32) % 251).astype(np.uint8).reshape(12, 10, 3)
    jpeg = io.BytesIO()
    PILImage.fromarray(arr).save(jpeg, format="JPEG")
    obs = Observation("look", [arr, PILImage.fromarray(arr), _png(arr), jpeg.getvalue(), arr[:, :, 0]])
    assert all(isinstance(i, Image) and (i.width, i.height) == (10, 12) for i in obs.images)
    for img in obs.images[:3]:
        assert np.array_equal(np.asarray(decode_image(img)), arr)
    assert obs.images[0].png == obs.images[1].png  # one encoding: the same pixels give the same bytes
    assert np.asarray(decode_image(obs.images[4]))[:, :, 0].tolist() == arr[:, :, 0].tolist()


@pytest.mark.parametrize(("images", "message"), [
    (["not an image"], "observation image 0 is a str"),
    ([np.zeros((4, 4, 3), dtype=np.float32)], "array of float32"),
    ([np.zeros((4, 4, 2), dtype=np.uint8)], "shape"),
    ([b"\x89PNG\r\n\x1a\n garbage"], "does not decode as an image"),
    (np.zeros((4, 4, 3), dtype=np.uint8), "wrap a single array in a list"),
    ("abc", "must be a list of images"),
])
def test_a_bad_image_is_refused_where_the_observation_is_made(images: object, message: str) -> None:
    with pytest.raises(EnvError, match=message):
        Observation("x", images)  # type: ignore[arg-type]


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    big = _png(np.zeros((40, 30, 3), dtype=np.uint8))
    monkeypatch.setattr(images_mod, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(EnvError, match=r"30x40 pixels, over the 1,000-pixel limit"):
        Observation("x", [big])
    with pytest.raises(EnvError, match="over the 1,000-pixel limit"):
        Observation("x", [np.zeros((40, 30), dtype=np.uint8)])


def test_an_environment_that_returns_neither_text_nor_an_observation_fails_its_reset_and_step() -> None:
    class Bad:
        def reset(self, seed: int) -> object:
            return PILImage.new("RGB", (2, 2))

        def step(self, action: str) -> StepResult:
            return StepResult(123, 0.0, False)  # type: ignore[arg-type]

    with pytest.raises(EnvError, match="must be a str or an earl_stream.env.Observation, got Image"):
        asyncio.run(env_reset(Bad(), 0))
    with pytest.raises(EnvError, match="got int"):
        asyncio.run(env_step(Bad(), "a"))


def test_images_cross_a_hosts_messages_byte_for_byte_and_are_checked_again_on_arrival() -> None:
    host = EnvHost("tictactoe_image")

    async def go() -> tuple[EnvOpened, EnvStepped]:
        opened = await host.handle(EnvOpen(episode="e", seed=3))
        stepped = await host.handle(EnvStep(episode="e", action="5"))
        return opened, stepped  # type: ignore[return-value]

    opened, stepped = asyncio.run(go())
    wire = msgspec.msgpack.Decoder(EnvOpened).decode(msgspec.msgpack.encode(opened))
    local = make_env("tictactoe_image")
    first = asyncio.run(env_reset(local, 3))
    assert isinstance(first, Observation) and wire.images[0].png == first.images[0].png
    obs = opened_observation(wire, "test")
    assert isinstance(obs, Observation) and obs.text == first.text and obs.images == first.images
    after = stepped_result(stepped, "test")
    assert isinstance(after.observation, Observation) and after.observation.images[0].png != first.images[0].png
    forged = msgspec.structs.replace(wire, images=(Image(png=b"not a png", width=96, height=96),))
    with pytest.raises(EnvError, match="image 0 from a sandbox does not decode"):
        opened_observation(forged, "a sandbox")
    lying = msgspec.structs.replace(wire, images=(dataclasses.replace(wire.images[0], width=5),))
    with pytest.raises(EnvError, match="says 5x96 but decodes to 96x96"):
        opened_observation(lying, "a sandbox")


PICTURES = '''
import numpy as np
from earl_stream.env import Observation, StepResult


class Pictures:
    def reset(self, seed):
        return Observation("first", [np.full((8, 6, 3), seed % 256, dtype=np.uint8)])

    def step(self, action):
        if action == "bad":
            return StepResult(Observation("x", [b"junk"]), 0.0, True)
        return StepResult(Observation(action, [np.eye(5, dtype=np.uint8) * 255, np.zeros((2, 3), np.uint8)]), 1.0, True)
'''


def test_a_sandboxed_environment_shows_its_images_byte_for_byte_and_a_bad_one_fails_its_episode(tmp_path: Path) -> None:
    (tmp_path / "pictures.py").write_text(PICTURES)
    spec = EnvSpec(spec=f"{tmp_path}/pictures.py:Pictures", params={})
    mode = "bwrap" if __import__("earl_stream.sandbox", fromlist=["x"]).bwrap_problem() is None else "process"

    async def go() -> None:
        runners = open_env_runners(load_config(None, [f"sandbox.mode={mode}"]), "pics")
        assert runners is not None
        try:
            local, [boxed] = make_env(spec.spec, spec.params), await runners.envs(spec, 1)
            a, b = await env_reset(local, 7), await env_reset(boxed, 7)
            assert isinstance(b, Observation) and a == b and b.images[0].png == a.images[0].png  # type: ignore[union-attr]
            a_step, b_step = await env_step(local, "two"), await env_step(boxed, "two")
            assert a_step == b_step and len(b_step.observation.images) == 2  # type: ignore[union-attr]
            [again] = await runners.envs(spec, 1)
            await env_reset(again, 1)
            with pytest.raises(EnvError, match="does not decode as an image"):
                await env_step(again, "bad")
            [after] = await runners.envs(spec, 1)  # the child serves the next episode
            assert isinstance(await env_reset(after, 2), Observation)
        finally:
            await runners.aclose()

    asyncio.run(go())


def test_image_url_parts_are_data_urls_checked_like_observations() -> None:
    img = Observation("", [np.full((3, 4, 3), 9, dtype=np.uint8)]).images[0]
    url = image_data_url(img)
    assert image_from_data_url(url) == img
    content = openai_content(Observation("what is here?", [img]))
    messages = [{"role": "user", "content": content}]
    [msg] = normalize(messages, vision=True)
    assert msg["content"] == "what is here?" and msg["images"] == [img]
    with pytest.raises(BadRequest, match="reads text only") as refused:
        normalize(messages)
    assert refused.value.status == 400 and refused.value.code == "unsupported_content"
    bad = [("https://example.com/a.png", "remote URLs are not fetched"),
           ("data:image/png;base64,@@@@", "not valid base64"),
           ("data:image/png;base64," + base64.b64encode(b"no image").decode(), "does not decode as an image"),
           (42, "must be a data URL string")]
    for url_, message in bad:
        part = {"type": "image_url", "image_url": {"url": url_}}
        with pytest.raises(BadRequest, match=message) as caught:
            normalize([{"role": "user", "content": [part]}], vision=True)
        assert caught.value.code == "invalid_image" and "messages[0].content[0].image_url" in str(caught.value)
    with pytest.raises(BadRequest, match="only text and image_url content parts"):
        normalize([{"role": "user", "content": [{"type": "audio"}]}])


def test_the_image_games_play_the_text_games_rules_on_pictures() -> None:
    async def play(env: object, moves: list[str]) -> list[StepResult]:
        await env_reset(env, 11)
        return [await env_step(env, m) for m in moves]

    pic, text = make_env("tictactoe_image"), TicTacToe()
    first = asyncio.run(env_reset(pic, 11))
    assert isinstance(first, Observation) and first.text == "Your move." and (first.images[0].width, first.images[0].height) == (96, 96)
    moves = ["5", "1", "9", "3", "7"]
    a, b = asyncio.run(play(pic, moves[:3])), asyncio.run(play(text, moves[:3]))
    assert [(r.reward, r.done, r.info) for r in a] == [(r.reward, r.done, r.info) for r in b]
    board = np.asarray(decode_image(Observation("", [tictactoe_picture(["X", "", "", "", "O", "", "", "", ""])]).images[0]))
    assert board[16, 16].tolist() == [20, 20, 20] and board[16, 48].tolist() == [255, 255, 255]  # X's centre, empty
    c4 = make_env("connect_four_image")
    obs = asyncio.run(env_reset(c4, 0))
    assert isinstance(obs, Observation) and (obs.images[0].width, obs.images[0].height) == (168, 144)
    step = asyncio.run(env_step(c4, "4"))
    pixels = np.asarray(decode_image(step.observation.images[0]))  # type: ignore[union-attr]
    assert pixels[5 * 24 + 12, 3 * 24 + 12].tolist() == [220, 30, 30]  # X's disc at the bottom of column 4
    grid = [["" for _ in range(7)] for _ in range(6)]
    assert np.asarray(decode_image(Observation("", [connect_four_picture(grid)]).images[0]))[12, 12].tolist() == [255, 255, 255]
    illegal = asyncio.run(play(make_env("tictactoe_image"), ["0"]))
    assert illegal[0].info == {"outcome": "illegal"} and illegal[0].reward == -1.0


def test_a_text_only_policy_fails_an_image_episode_alone_saying_why(tiny_model_dir: Path) -> None:
    """The built-in agent loop with a text-only model: the episode of an image game fails (EpisodeFailed, which
    the rollout worker counts and moves past), the engine and the next text episode are unharmed."""
    import torch

    from earl_stream.model import load_model
    from earl_stream.model.chat import ChatFormat
    from earl_stream.workers.agent_loop import EpisodeFailed, Sampling, play_episode
    from earl_stream.workers.engines.batcher import AsyncBatcher
    from earl_stream.workers.engines.torch_engine import TorchEngine

    torch.manual_seed(0)
    model, tokenizer = load_model(tiny_model_dir)

    async def go() -> None:
        batcher = AsyncBatcher(TorchEngine(model.eval(), seed=0))
        try:
            def episode(spec: str) -> object:
                return play_episode(make_env(spec), None, ChatFormat(tokenizer), batcher, env_name=spec, seed=1,
                                    prompt_ordinal=0, group_id="g", sampling=Sampling(temperature=0.0),
                                    policy_version=lambda: 0, decode=tokenizer.decode)
            with pytest.raises(EpisodeFailed, match="first observation carries 1 image.* reads text only"):
                await episode("tictactoe_image")
            record = await episode("tictactoe")
            assert record.turns >= 1  # type: ignore[attr-defined]
        finally:
            await batcher.aclose()

    asyncio.run(go())
