"""Token-in/token-out rendering of multi-turn chats for the agent loop.

The agent loop never re-tokenizes what the model generated: an episode's token ids are the first
turn's prompt, then for every turn the model's sampled tokens (ending with its end-of-turn token),
then the tokens that open the next user turn and the next assistant header. `ChatFormat` derives
those pieces from any Hugging Face tokenizer's chat template, so that the concatenation equals the
tokenization of the full chat-template rendering. Sampling, stopping and the episode record are
the agent loop's and the engine's business.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from transformers import PreTrainedTokenizerBase

from earl_stream.errors import ModelError

__all__ = ["ChatFormat"]

logger = logging.getLogger(__name__)

# A reply that no template rewrites, used only to locate where an assistant turn's content ends.
_PROBE_REPLY = "EARLPROBEREPLY"
_PROBE_USER = "EARLPROBEUSER"
_CACHE_SIZE = 8192


class ChatFormat:
    """The token pieces of a multi-turn chat under `tokenizer`'s chat template.

    Attributes:
        end_token_id: the token that closes an assistant turn (e.g. `<|end|>`, `<|im_end|>`).
        stop_token_ids: tokens that end a generated turn: the end-of-turn token and the eos token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError(f"tokenizer {type(tokenizer).__name__} has no chat_template; ChatFormat needs one")
        self._tok = tokenizer
        self.end_token_id: int = self._find_end_token()
        stops = {self.end_token_id}
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self._next_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = self._tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        if not isinstance(text, str):
            raise ModelError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def _encode(self, text: str) -> list[int]:
        # Special tokens in the rendered text (turn markers, bos) are parsed from the text itself.
        return list(self._tok.encode(text, add_special_tokens=False))

    def _find_end_token(self) -> int:
        rendered = self._render(
            [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}],
            add_generation_prompt=False,
        )
        at = rendered.rfind(_PROBE_REPLY)
        if at < 0:
            raise ModelError("the chat template drops assistant content; cannot find its end-of-turn token")
        after = self._encode(rendered[at + len(_PROBE_REPLY):])
        special = set(self._tok.all_special_ids)
        if after and after[0] in special:
            return int(after[0])
        if self._tok.eos_token_id is None:
            raise ModelError("the chat template closes assistant turns with no special token and there is no eos")
        logger.warning("chat template has no end-of-turn token after assistant content; using eos")
        return int(self._tok.eos_token_id)

    def _after_end(self, rendered: str) -> str:
        """The text of `rendered` after the probe reply's end-of-turn marker."""
        at = rendered.rfind(_PROBE_REPLY)
        if at < 0:
            raise ModelError("the chat template drops assistant content of earlier turns")
        rest = rendered[at + len(_PROBE_REPLY):]
        marker = self._tok.convert_ids_to_tokens(self.end_token_id)
        if not isinstance(marker, str) or not rest.startswith(marker):
            raise ModelError(f"the chat template does not close assistant turns with {marker!r}")
        return rest[len(marker):]

    def first_turn(self, system: str | None, observation: str) -> list[int]:
        """Token ids of [system?, user(observation)] plus the assistant generation prompt.

        Returns a new list of int token ids ([T] in the episode's int32 `input_ids`).
        """
        return self._encode(self.first_turn_text(system, observation))

    def first_turn_text(self, system: str | None, content: str | list[dict[str, Any]]) -> str:
        """The rendered text of `first_turn`; `content` may be a list of content parts (a vision-language
        template's `{"type": "image"}` and `{"type": "text", "text": ...}`)."""
        messages: list[dict[str, Any]] = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": content})
        return self._render(messages, add_generation_prompt=True)

    def next_turn(self, observation: str) -> list[int]:
        """Token ids that follow the model's end-of-turn token: the user turn and the next assistant header.

        Derived by rendering a conversation that ends with an assistant reply, with and without the
        extra user turn and generation prompt, and keeping what follows the reply's end marker.
        Results are cached per observation (boards repeat); a new list is returned every call.
        """
        cached = self._next_cache.get(observation)
        if cached is not None:
            self._next_cache.move_to_end(observation)
            return list(cached)
        ids = tuple(self._encode(self.next_turn_text(observation)))
        self._next_cache[observation] = ids
        if len(self._next_cache) > _CACHE_SIZE:
            self._next_cache.popitem(last=False)
        return list(ids)

    def next_turn_text(self, content: str | list[dict[str, Any]]) -> str:
        """The rendered text of `next_turn` (what follows the model's end-of-turn token); `content` as in
        `first_turn_text`."""
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        closed = self._after_end(self._render(base, add_generation_prompt=False))
        extended = self._after_end(self._render([*base, {"role": "user", "content": content}], add_generation_prompt=True))
        # Text the template puts after an end marker (e.g. "\n") belongs to the closed turn too.
        if not extended.startswith(closed):
            raise ModelError("the chat template renders earlier turns differently once a turn is added")
        return extended

    def reply_text(self, reply_ids: list[int]) -> str:
        """Decode a generated reply to the action text, without its stop token(s)."""
        while reply_ids and reply_ids[-1] in self.stop_token_ids:
            reply_ids = reply_ids[:-1]
        return str(self._tok.decode(reply_ids, skip_special_tokens=False))
