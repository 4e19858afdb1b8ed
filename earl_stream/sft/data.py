"""SFT data: chat transcripts read from JSONL and rendered to token ids with an assistant-only loss mask.

One transcript per line: `{"messages": [{"role": ..., "content": ...}, ...]}` (OpenAI-style). The
tokens are those of the tokenizer's chat template, rendered turn by turn: every prefix of the
conversation is rendered and the new text tokenized on its own, the way the agent loop builds an
episode (`earl_stream.model.chat`), so a model trained here sees exactly the token sequences RL will give
it. The mask is 1 on each assistant turn's content and its end-of-turn token (what the model
generates before the engine stops it), 0 on everything else (system, user, tool turns, the assistant
header, and any text the template puts after the end-of-turn token).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from earl_stream.errors import ConfigError
from earl_stream.model.chat import ChatFormat
from earl_stream.records import SampleImage

__all__ = ["Example", "TranscriptError", "load_transcripts", "tokenize_chat"]

_ROLES = ("system", "user", "assistant", "tool")


class TranscriptError(ConfigError):
    """A transcript file or transcript that cannot be trained on; the message names the line."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized transcript: input_ids [T] int32, loss_mask [T] uint8 (1 on assistant tokens), and for a
    vision-language model its `images` (each the span of positions its processor tokens take, in order)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    images: tuple[SampleImage, ...] = ()

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.loss_mask.shape or self.input_ids.ndim != 1:
            raise ValueError(f"input_ids {self.input_ids.shape} and loss_mask {self.loss_mask.shape} must be equal [T]")
        for img in self.images:
            if img.start < 0 or img.tokens <= 0 or img.start + img.tokens > self.num_tokens:
                raise ValueError(f"an image at [{img.start}, {img.start + img.tokens}) is outside the example's "
                                 f"{self.num_tokens} tokens")

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _check_messages(obj: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise TranscriptError(f"{where}: expected an object {{\"messages\": [...]}} with a non-empty list")
    out = []
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise TranscriptError(f"{where}: message {i} must be {{\"role\": one of {list(_ROLES)}, "
                                  f"\"content\": str}}, got {str(m)[:80]!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise TranscriptError(f"{where}: no assistant message, nothing to train on")
    return out


def load_transcripts(path: str | os.PathLike[str]) -> list[list[dict[str, str]]]:
    """The conversations of a JSONL file, in file order (blank lines skipped).

    Raises `TranscriptError` naming the file and the 1-based line of the first malformed line.
    """
    out = []
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise TranscriptError(f"cannot read transcripts {path}: {exc.strerror}") from None
    with fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TranscriptError(f"{path}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            out.append(_check_messages(obj, f"{path}:{n}"))
    if not out:
        raise TranscriptError(f"{path}: no transcripts")
    return out


def tokenize_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]],
                  fmt: ChatFormat | None = None) -> Example:
    """Token ids of `messages` under the chat template, the mask on the assistant turns' tokens.

    Each assistant turn contributes the generation prompt's header (mask 0), its content and its
    end-of-turn token (mask 1), and whatever the template renders after that token (mask 0).
    """
    fmt = fmt or ChatFormat(tokenizer)
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            head = _render(tokenizer, messages[:i], generation_prompt=True)
            _append(ids, mask, tokenizer, _new_text(done, head), 0)
            done = head
        full = _render(tokenizer, messages[: i + 1], generation_prompt=False)
        piece = _encode(tokenizer, _new_text(done, full))
        done = full
        if msg["role"] != "assistant":
            ids += piece
            mask += [0] * len(piece)
            continue
        if fmt.end_token_id not in piece:
            raise TranscriptError(f"the chat template does not close assistant turn {i} with its end-of-turn token")
        end = piece.index(fmt.end_token_id) + 1
        ids += piece
        mask += [1] * end + [0] * (len(piece) - end)
    return Example(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8))


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], *, generation_prompt: bool) -> str:
    if not messages:
        return ""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    return str(text)


def _new_text(done: str, now: str) -> str:
    if not now.startswith(done):
        raise TranscriptError("the chat template renders earlier turns differently once a turn is added; "
                              "turn-by-turn tokenization (as the agent loop does) is not possible with it")
    return now[len(done):]


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _append(ids: list[int], mask: list[int], tokenizer: PreTrainedTokenizerBase, text: str, value: int) -> None:
    piece = _encode(tokenizer, text)
    ids += piece
    mask += [value] * len(piece)
