"""Response shapes of forge's Anthropic-compatible Messages API: the message body, its content blocks,
the stream's events, usage, stop reasons, the error envelope, and the model list in the Models API's
shape. Pure builders of plain dicts ready for msgspec.json.encode; each event is framed named by its
type (forge/api/sse.py's sse_event), the ping too.

The content blocks are built from the tool-call reader's events (forge.text.tool_calls) in order, one way for
both shapes: a stream sends the block events as each delta adds them, a body is the blocks they make,
so a client accumulating the stream gets the body.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from forge.api.sse import sse_event
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolCallReader, ToolEvent

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# An error's status -> its type in the Messages API's envelope. forge answers overload (and loading,
# draining) with 503 and Retry-After on every route, so here too: clients retry a 503 as they do a 529.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """The Messages API's id of a call forge's reader named ("call_<hex>" -> "toolu_<hex>")."""
    return f"toolu_{call_id.removeprefix('call_')}"


PING = sse_event({"type": "ping"})


# ---- errors ---------------------------------------------------------------------------------------------

def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}; the envelope has no param, so the message names it."""
    if param and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# ---- the model list --------------------------------------------------------------------------------------

# A model's created_at: the epoch, the Models API's value for a release date not known (as OpenAI's created 0)
EPOCH = "1970-01-01T00:00:00Z"
MAX_PAGE = 1000                 # the most models one page may hold (limit's range is 1-1000, default 20)


def model_info(model_id: str, *, max_model_len: int | None) -> dict[str, Any]:
    """A model as the Models API describes it; its context (max_input_tokens, max_tokens) is known once loaded."""
    return {"type": "model", "id": model_id, "display_name": model_id, "created_at": EPOCH, "lifecycle": "active",
            "max_input_tokens": max_model_len, "max_tokens": max_model_len}


def model_page(infos: Sequence[dict[str, Any]], *, limit: int = 20, after_id: str | None = None,
               before_id: str | None = None) -> dict[str, Any]:
    """One page of the list: the `limit` models after `after_id` (or just before `before_id`), with
    has_more and the page's first_id and last_id, as the Models API pages. An id not listed: ValueError."""
    ids = [info["id"] for info in infos]
    start = ids.index(after_id) + 1 if after_id is not None else 0
    end = ids.index(before_id) if before_id is not None else len(ids)
    window = list(infos[start:end])
    page = window[-limit:] if before_id is not None and after_id is None else window[:limit]
    return {"data": page, "has_more": len(window) > len(page),
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


# ---- usage, stop reasons, the body ----------------------------------------------------------------------

def usage(*, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """The Messages API counts input apart from what the cache served: input_tokens +
    cache_read_input_tokens is the whole prompt. forge writes no cache on request, so
    cache_creation_input_tokens is always 0."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def stop_reason(finish_reason: str | None, stop_string: str | None, *, has_tool_use: bool) -> StopReason:
    """forge's finish reason as the Messages API's: the length limit -> max_tokens, a stop string ->
    stop_sequence, an end after tool calls -> tool_use, any other end -> end_turn."""
    if finish_reason in (None, "length"):
        return "max_tokens"
    if stop_string is not None:
        return "stop_sequence"
    return "tool_use" if has_tool_use else "end_turn"


def message(*, message_id: str, model: str, content: Sequence[dict[str, Any]], stop_reason: StopReason | None,
            stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": list(content),
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}


def message_start(*, message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The stream's first event: the message with no content yet. The prefix cache's share of the prompt
    is known once the prompt has run, so the split of input_tokens comes with message_delta."""
    start = usage(prompt_tokens=input_tokens, cached_tokens=0, output_tokens=0)
    return {"type": "message_start", "message": message(message_id=message_id, model=model, content=[],
                                                        stop_reason=None, stop_sequence=None, usage=start)}


def message_delta(*, stop_reason: StopReason, stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    """The stream's last change: why it ended, and the final usage (cumulative; it replaces message_start's)."""
    return {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": usage}


MESSAGE_STOP: dict[str, Any] = {"type": "message_stop"}


# ---- content blocks -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ThinkingDelta:
    """A piece of a reasoning model's thinking section (forge.sampling.reasoning): a thinking block's text."""
    text: str


BlockEvent = ToolEvent | ThinkingDelta


def text_events(calls: ToolCallReader | None, text: str, *, final: bool) -> list[ToolEvent]:
    """The events a piece of generated text makes: through the tool-call reader when the request has
    tools, else the text as it is."""
    if calls is None:
        return [ContentDelta(text)] if text else []
    return calls.push(text) + (calls.finish() if final else [])


class ContentBlocks:
    """A message's content blocks, made from the tool reader's events in order: text joins an open text
    block or opens one; thinking likewise a thinking block (its signature empty: forge signs nothing); a
    call opens a tool_use block whose input arrives as JSON text. push() and
    close() return the stream's events for what they added; content() is the blocks as a body has them."""

    def __init__(self) -> None:
        self._blocks: list[dict[str, Any]] = []
        self._inputs: dict[int, str] = {}            # tool_use block index -> its input's JSON text so far
        self._open: int | None = None                # the index of the block still growing

    @property
    def has_tool_use(self) -> bool:
        return bool(self._inputs)

    def push(self, events: Sequence[BlockEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            match event:
                case ThinkingDelta(text=text) if text:
                    if self._open is None or self._blocks[self._open]["type"] != "thinking":
                        self._start(out, {"type": "thinking", "thinking": "", "signature": ""})
                    assert self._open is not None
                    self._blocks[self._open]["thinking"] += text
                    out.append(_delta(self._open, {"type": "thinking_delta", "thinking": text}))
                case ContentDelta(text=text) if text:
                    if self._open is None or self._blocks[self._open]["type"] != "text":
                        self._start(out, {"type": "text", "text": ""})
                    assert self._open is not None
                    self._blocks[self._open]["text"] += text
                    out.append(_delta(self._open, {"type": "text_delta", "text": text}))
                case CallStart(id=call_id, name=name):
                    self._start(out, {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": {}})
                    assert self._open is not None
                    self._inputs[self._open] = ""
                case ArgumentsDelta(text=text) if text and self._open in self._inputs:
                    assert self._open is not None
                    self._inputs[self._open] += text
                    out.append(_delta(self._open, {"type": "input_json_delta", "partial_json": text}))
        return out

    def close(self) -> list[dict[str, Any]]:
        """End the open block, if any (the message is complete)."""
        out: list[dict[str, Any]] = []
        self._stop(out)
        return out

    def content(self) -> list[dict[str, Any]]:
        """The blocks, each tool_use's input parsed (an input cut short, or not an object, is {})."""
        blocks = [dict(b) for b in self._blocks]
        for i, text in self._inputs.items():
            blocks[i]["input"] = _object(text)
        return blocks

    def _start(self, out: list[dict[str, Any]], block: dict[str, Any]) -> None:
        self._stop(out)
        self._open = len(self._blocks)
        self._blocks.append(block)
        out.append({"type": "content_block_start", "index": self._open, "content_block": dict(block)})

    def _stop(self, out: list[dict[str, Any]]) -> None:
        if self._open is not None:
            out.append({"type": "content_block_stop", "index": self._open})
            self._open = None


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
