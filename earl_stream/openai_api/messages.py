"""Chat messages of the OpenAI API as the chat template sees them, and the model's replies as the
API shows them.

It owns: checking and normalising request messages (so that a conversation the client re-sends can be
compared with the one held, whatever extra fields its client library adds), rendering a conversation
with the tokenizer's chat template (with the `tools` of the request: natively where the template
knows tools, else as earl_stream's tool-call block in the system prompt, tool results as user turns),
and turning a generated reply into an assistant message with OpenAI `tool_calls`. Tokens and the
episode's accounting are `episodes`'s job.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from earl_stream.env.images import Image, image_from_data_url
from earl_stream.env.tools import ToolCall, parse_tool_call
from earl_stream.errors import EarlError, EnvError, ModelError

ROLES = ("system", "developer", "user", "assistant", "tool")
Message = dict[str, Any]


class BadRequest(EarlError):
    """A request the API refuses: `status` is the HTTP status, `code`/`param` go into the error object."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def _content(content: Any, where: str) -> tuple[str, list[Image]]:
    """A message's text and images: a string, null, or content parts (`text`, and `image_url` with a base64 data
    URL; a bad image is refused here, naming its part)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts, images = [], []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                ref = part.get("image_url")
                url = ref.get("url") if isinstance(ref, dict) else ref
                try:
                    images.append(image_from_data_url(url, f"{where}.content[{k}].image_url"))
                except EnvError as exc:
                    raise BadRequest(str(exc), param=where, code="invalid_image") from None
            else:
                raise BadRequest(f"{where}.content[{k}]: only text and image_url content parts are supported",
                                 param=where)
        return "".join(texts), images
    raise BadRequest(f"{where}: content must be a string, a list of content parts or null", param=where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list", param=where)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}.tool_calls[{i}] needs function.name", param=where)
        args = fn.get("arguments", "{}")
        out.append({"id": str(call.get("id", "")), "name": fn["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args)})
    return out


def normalize(messages: Any, *, vision: bool = False) -> list[Message]:
    """Checked messages with only what the template and the comparison need:
    {role, content: str, images?: [Image], tool_calls?: [{id, name, arguments}], tool_call_id?, name?}.
    Images are refused unless the model reads them (`vision`): after they were checked, so that a bad image is
    reported as such."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out: list[Message] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {list(ROLES)}, got {role!r}", param="messages")
        text, images = _content(m.get("content"), where)
        msg: Message = {"role": "system" if role == "developer" else role, "content": text}
        if images:
            if not vision:
                raise BadRequest(f"{where} carries {len(images)} image(s) and this endpoint's model reads text only",
                                 param=where, code="unsupported_content")
            msg["images"] = images
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id", ""))
        out.append(msg)
    return out


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's `tools` as [{name, description, parameters}] (function tools only)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        out.append({"name": fn["name"], "description": str(fn.get("description", "")),
                    "parameters": fn.get("parameters") or {"type": "object", "properties": {}}})
    return out


def _tools_block(tools: list[dict[str, Any]]) -> str:
    lines = ["You can call a tool by replying with exactly one call of this form:",
             '<tool>{"name": "TOOL_NAME", "arguments": {...}}</tool>',
             'Its result comes back as the next message ("tool result: ...").', "Tools:"]
    for t in tools:
        lines.append(f"- {t['name']}: {t['description']}")
        lines.append(f"  arguments (JSON schema): {json.dumps(t['parameters'], separators=(', ', ': '))}")
    return "\n".join(lines)


class ChatRenderer:
    """Renders normalised conversations with one tokenizer's chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tok = tokenizer
        template = tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ModelError("the tokenizer has no chat template; the OpenAI chat endpoint needs one")
        self.native_tools = "tool_calls" in template or "tools" in template  # the template renders tools, tool calls and tool turns itself

    def render(self, messages: list[Message], tools: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        """The template's text of the conversation (BadRequest when the template refuses it)."""
        try:
            if self.native_tools:
                text = self._tok.apply_chat_template(
                    [_native(m) for m in messages], tools=[{"type": "function", "function": t} for t in tools] or None,
                    tokenize=False, add_generation_prompt=add_generation_prompt)
            else:
                text = self._tok.apply_chat_template(_plain(messages, tools), tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja's raise_exception, or a template bug: the request is refused
            raise BadRequest(f"the chat template cannot render these messages: {exc}", param="messages") from None
        if not isinstance(text, str):
            raise ModelError(f"chat template rendered {type(text).__name__}, expected str")
        return text


def _native(m: Message) -> Message:
    out: Message = {"role": m["role"], "content": m["content"]}
    if "tool_calls" in m:
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": _json_or_text(c["arguments"])}}
                             for c in m["tool_calls"]]
    if "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _plain(messages: list[Message], tools: list[dict[str, Any]]) -> list[dict[str, str]]:
    """For templates that know only system/user/assistant: earl_stream's tool-call text format."""
    out: list[dict[str, str]] = []
    if tools:
        block = _tools_block(tools)
        if messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"tool result: {m['content']}"})
        elif m.get("tool_calls"):
            calls = "".join(f'<tool>{{"name": {json.dumps(c["name"])}, "arguments": {c["arguments"]}}}</tool>'
                            for c in m["tool_calls"])
            out.append({"role": "assistant", "content": m["content"] + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def reply_message(text: str, tools: list[dict[str, Any]]) -> Message:
    """The normalised assistant message for a generated reply: a tool call (when the request offered
    tools and the reply calls one of them) or plain content."""
    if tools:
        parsed = parse_tool_call(text)
        if isinstance(parsed, ToolCall) and parsed.name in {t["name"] for t in tools}:
            before = text[:max(text.find("<tool"), 0)].strip()
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": parsed.name,
                    "arguments": json.dumps(parsed.arguments)}
            return {"role": "assistant", "content": before, "tool_calls": [call]}
    return {"role": "assistant", "content": text}


def api_message(m: Message) -> dict[str, Any]:
    """A normalised assistant message as the API returns it."""
    out: dict[str, Any] = {"role": "assistant", "content": m["content"] if m["content"] or "tool_calls" not in m else None}
    if "tool_calls" in m:
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
    return out
