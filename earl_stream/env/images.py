"""Images in observations: what an environment may show the model beside text, checked once where it enters.

An environment returns either a `str` or an `Observation(text, images)`; each image may be a PIL image, a
uint8 array (H x W, H x W x 3 or H x W x 4) or encoded bytes (PNG, JPEG, ...). `Observation` turns every one
into an `Image`: PNG bytes with their size, checked to decode and to stay within `MAX_IMAGE_PIXELS`, so that
what crosses a sandbox, an environment server or the experience store is the same bytes everywhere and a bad
image fails its episode (an `EnvError`) where it was made, never a worker. The OpenAI endpoint's `image_url`
content parts arrive as data URLs (`image_from_data_url`); nothing is fetched from the network.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from earl_stream.errors import EnvError

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "Image", "Observation", "as_image", "decode_image",
           "image_data_url", "image_from_data_url", "join_observation", "observation_text", "openai_content",
           "received_images", "split_observation"]

# Far above what a vision processor takes (Qwen2.5-VL's default max_pixels is 12.8M, SmolVLM resizes to a
# 1,536-pixel longest edge): a guard against an environment that returns a runaway array, not a model limit.
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGE_BYTES = 32 << 20  # an encoded image (or a data URL's payload) larger than this is refused
_DATA_URL = re.compile(r"data:image/([a-z0-9.+-]+);base64,(.*)", re.S | re.I)


@dataclass(frozen=True)
class Image:
    """One image of an observation: PNG bytes (lossless, so every copy decodes to the same pixels) and the
    size they decode to. Make one with `as_image`; it is what travels on the wire (msgspec encodes it) and in
    the store."""

    png: bytes
    width: int
    height: int


def _pil() -> Any:
    from PIL import Image as PILImage  # a dependency, imported late: a text-only run never loads it

    return PILImage


def _is_array(obj: object) -> bool:
    """Whether `obj` is a numpy array (numpy is imported only where an image needs it)."""
    return type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray"


def _checked_size(width: int, height: int, what: str) -> None:
    if width < 1 or height < 1:
        raise EnvError(f"{what} is empty ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise EnvError(f"{what} is {width}x{height} pixels, over the {MAX_IMAGE_PIXELS:,}-pixel limit of an "
                       "observation's image")


def _from_pil(img: Any, what: str) -> Image:
    _checked_size(img.width, img.height, what)
    if img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGB")
    out = io.BytesIO()
    img.save(out, format="PNG")
    return Image(png=out.getvalue(), width=img.width, height=img.height)


def _from_array(arr: Any, what: str) -> Image:
    import numpy as np

    if arr.dtype != np.uint8:
        raise EnvError(f"{what} is an array of {arr.dtype}; an image array must be uint8 (0-255)")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise EnvError(f"{what} is an array of shape {arr.shape}; an image is H x W, H x W x 3 or H x W x 4")
    _checked_size(int(arr.shape[1]), int(arr.shape[0]), what)
    return _from_pil(_pil().fromarray(np.ascontiguousarray(arr)), what)  # uint8: L, RGB or RGBA by its shape


def _from_bytes(data: bytes, what: str) -> Image:
    if len(data) > MAX_IMAGE_BYTES:
        raise EnvError(f"{what} is {len(data):,} bytes, over the {MAX_IMAGE_BYTES:,}-byte limit of an image")
    PILImage = _pil()
    try:
        with PILImage.open(io.BytesIO(data)) as probe:  # the header alone: refuse a bomb before decoding it
            _checked_size(probe.width, probe.height, what)
            img = probe.convert("RGBA" if probe.mode in ("RGBA", "LA", "P") else "RGB")
    except EnvError:
        raise
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, ValueError, DecompressionBombError
        raise EnvError(f"{what} does not decode as an image: {type(exc).__name__}: {exc}") from None
    return _from_pil(img, what)


def as_image(obj: object, what: str = "image") -> Image:
    """`obj` (an `Image`, a PIL image, a uint8 array or encoded image bytes) as an `Image`; an `EnvError` that
    names `what` and the problem otherwise."""
    if isinstance(obj, Image):
        return obj
    if _is_array(obj):
        return _from_array(obj, what)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return _from_bytes(bytes(obj), what)
    pil = _pil()
    if isinstance(obj, pil.Image):
        return _from_pil(obj, what)
    raise EnvError(f"{what} is a {type(obj).__name__}; an image is a PIL image, a uint8 array or encoded "
                   "image bytes (PNG, JPEG)")


def decode_image(image: Image) -> Any:
    """The PIL image (RGB) of `image`."""
    with _pil().open(io.BytesIO(image.png)) as img:
        return img.convert("RGB")


@dataclass(frozen=True)
class Observation:
    """What an environment shows the model: `text` and the `images` shown before it in the same user turn
    (several per turn allowed). The images are checked and converted on construction (see `as_image`): a bad
    one raises `EnvError` here, which fails the episode."""

    text: str
    images: Sequence[Any] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise EnvError(f"Observation.text must be a str, got {type(self.text).__name__}")
        if _is_array(self.images):  # one array is one image, not a list of rows
            raise EnvError("Observation.images must be a list of images; wrap a single array in a list")
        if isinstance(self.images, (str, bytes)) or not isinstance(self.images, Sequence):
            raise EnvError(f"Observation.images must be a list of images, got {type(self.images).__name__}")
        checked = tuple(as_image(img, f"observation image {i}") for i, img in enumerate(self.images))
        object.__setattr__(self, "images", checked)


def split_observation(observation: object, what: str = "observation") -> tuple[str, tuple[Image, ...]]:
    """An environment's observation (`str` or `Observation`) as its text and its checked images."""
    if isinstance(observation, str):
        return observation, ()
    if isinstance(observation, Observation):
        return observation.text, tuple(observation.images)
    raise EnvError(f"{what} must be a str or an earl_stream.env.Observation, got {type(observation).__name__}")


def observation_text(observation: object, what: str = "observation") -> str:
    """The text of an observation where the reader takes text only (a text-only model): one with images is
    refused with an `EnvError` that says so."""
    text, images = split_observation(observation, what)
    if images:
        raise EnvError(f"the {what} carries {len(images)} image(s) and this model reads text only; use a "
                       "vision-language model (model.path of a Qwen2.5-VL or SmolVLM/Idefics3 checkpoint)")
    return text


def image_data_url(image: Image) -> str:
    """`image` as a data URL (the OpenAI API's `image_url.url`)."""
    return "data:image/png;base64," + base64.b64encode(image.png).decode("ascii")


def image_from_data_url(url: object, what: str = "image_url") -> Image:
    """The image of an OpenAI `image_url` content part: a base64 data URL (`data:image/png;base64,...`, any
    format PIL decodes). A remote URL is refused: the endpoint fetches nothing."""
    if not isinstance(url, str):
        raise EnvError(f"{what} must be a data URL string, got {type(url).__name__}")
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        head = url[:40] + ("..." if len(url) > 40 else "")
        raise EnvError(f"{what} {head!r} is not a base64 image data URL (data:image/png;base64,...); remote URLs "
                       "are not fetched")
    if len(m[2]) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise EnvError(f"{what} is over the {MAX_IMAGE_BYTES:,}-byte limit of an image")
    try:
        data = base64.b64decode(m[2], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EnvError(f"{what} is not valid base64: {exc}") from None
    return as_image(data, what)


def received_images(images: Sequence[Image], sender: str) -> tuple[Image, ...]:
    """Images that arrived from another process (a sandboxed environment, an environment server): decoded again,
    since the sender may not be trusted, and their stated size checked against the pixels."""
    out = []
    for i, img in enumerate(images):
        got = _from_bytes(img.png, f"image {i} from {sender}")
        if (got.width, got.height) != (img.width, img.height):
            raise EnvError(f"image {i} from {sender} says {img.width}x{img.height} but decodes to {got.width}x{got.height}")
        out.append(img)
    return tuple(out)


def join_observation(text: str, images: Sequence[Image]) -> str | Observation:
    """The observation of a text and its (checked) images: the text alone where there are none."""
    return Observation(text, tuple(images)) if images else text


def openai_content(observation: str | Observation) -> str | list[dict[str, Any]]:
    """An observation as an OpenAI chat message's `content`: its text, or content parts (each image as an
    `image_url` data URL, then the text) where it carries images."""
    text, images = split_observation(observation)
    if not images:
        return text
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images]
    return [*parts, {"type": "text", "text": text}]
