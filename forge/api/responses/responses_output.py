"""Response shapes of forge's Responses API: the response object, its output items, usage and the typed
stream events (framed by forge/api/sse.py's sse_event, numbered by `sequence_number`).
Pure builders of plain dicts ready for msgspec.json.encode; errors are OpenAI's envelope
(forge/api/openai/openai_output.py), as on chat.

The output items are built from the tool-call reader's events (forge.text.tool_calls) in order, one way for
both shapes: a stream sends the item events as each delta adds them, a body is the items they make,
so a client accumulating the stream gets the body.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from forge.api.responses.responses_schema import FormatText, ResponsesRequest, output_bound
from forge.api.responses.responses_tools import echoed, warnings
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolEvent

Status = Literal["in_progress", "completed", "incomplete", "failed"]

_encoder = msgspec.json.Encoder()


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _new_item_id(kind: Literal["msg", "fc", "rs"]) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


# ---- the response object --------------------------------------------------------------------------------

def usage(*, prompt_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    """input_tokens is the whole prompt, cached_tokens the share the prefix cache served (as chat's
    prompt_tokens and cached_tokens); reasoning_tokens the output tokens inside a thinking section. forge
    writes no cache on request: cache_write_tokens is 0."""
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings a response repeats (the clients' Response model requires several):
    max_output_tokens as applied (the default when the request set none), the tools offered to the model,
    and `warnings` (forge's) when tools it does not run were left out."""
    fmt = req.text.format
    notes = warnings(req.tools)
    return {"instructions": req.instructions, "max_output_tokens": output_bound(req),
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": msgspec.to_builtins(fmt) if not isinstance(fmt, FormatText) else {"type": "text"}},
            "tool_choice": msgspec.to_builtins(req.tool_choice) if req.tool_choice is not None else "auto",
            "tools": echoed(req.tools), "truncation": "disabled",
            "user": req.user, "background": False,
            "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning is not None else None,
            **({"warnings": notes} if notes else {})}


def response(*, response_id: str, created_at: int, model: str, status: Status, echoed: dict[str, Any],
             output: Sequence[dict[str, Any]] = (), usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object; incomplete means the length limit ended it (the only cause forge has)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status, "error": error,
            "incomplete_details": incomplete, "model": model, "output": list(output), "usage": usage, **echoed}


def status(finish_reason: str | None) -> Status:
    """A choice that ended by the length limit (or the context's end) is incomplete; any other end completes."""
    return "incomplete" if finish_reason in (None, "length") else "completed"


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def error_event(*, message: str, code: str | None, param: str | None) -> dict[str, Any]:
    """The stream's error event (the engine failed mid-stream); response.failed follows it."""
    return {"type": "error", "code": code, "message": message, "param": param}


# ---- output items ---------------------------------------------------------------------------------------

class OutputItems:
    """A response's output items, made from the tool reader's events in order: text joins an open
    message item or opens one; a call opens a function_call item whose arguments arrive as JSON text;
    a reasoning model's thinking section (push_reasoning) is a reasoning item before them, its text one
    reasoning_text part. push(), push_reasoning() and close() return the stream's events for what they
    added (without sequence numbers); items() is the output as the body has it. `names`: a called name ->
    (namespace, name) as a call's item carries them (responses_tools.call_names; others as called).
    """

    def __init__(self, names: Mapping[str, tuple[str | None, str]] | None = None) -> None:
        self._items: list[dict[str, Any]] = []
        self._open: int | None = None                # the index of the item still growing
        self._names = names or {}

    def push(self, events: Sequence[ToolEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            match event:
                case ContentDelta(text=text) if text:
                    if self._open is None or self._items[self._open]["type"] != "message":
                        self._open_message(out)
                    assert self._open is not None
                    item = self._items[self._open]
                    item["content"][0]["text"] += text
                    out.append({"type": "response.output_text.delta", "item_id": item["id"],
                                "output_index": self._open, "content_index": 0, "delta": text, "logprobs": []})
                case CallStart(id=call_id, name=called):
                    namespace, name = self._names.get(called, (None, called))
                    item = {"id": _new_item_id("fc"), "type": "function_call", "status": "in_progress",
                            "call_id": call_id, "name": name, "arguments": ""}
                    self._start(out, item if namespace is None else {**item, "namespace": namespace})
                case ArgumentsDelta(text=text) if text and self._open is not None:
                    item = self._items[self._open]
                    if item["type"] == "function_call":
                        item["arguments"] += text
                        out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                                    "output_index": self._open, "delta": text})
        return out

    def push_reasoning(self, text: str) -> list[dict[str, Any]]:
        """Thinking text: it joins the open reasoning item or opens one (with its one reasoning_text part)."""
        out: list[dict[str, Any]] = []
        if not text:
            return out
        if self._open is None or self._items[self._open]["type"] != "reasoning":
            self._start(out, {"id": _new_item_id("rs"), "type": "reasoning", "status": "in_progress",
                              "summary": [], "content": []})
            assert self._open is not None
            part = {"type": "reasoning_text", "text": ""}
            self._items[self._open]["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": self._items[self._open]["id"],
                        "output_index": self._open, "content_index": 0, "part": dict(part)})
        item = self._items[self._open]
        item["content"][0]["text"] += text
        out.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": self._open,
                    "content_index": 0, "delta": text})
        return out

    def close(self, final: Status) -> list[dict[str, Any]]:
        """End the open item with the response's status (`final`); an answer with no item at all is
        one empty message, so every response has its text (one that only thought has only its reasoning
        item, as chat's content is then null)."""
        out: list[dict[str, Any]] = []
        if not self._items:
            self._open_message(out)
        self._stop(out, final)
        return out

    def items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = _copy(self._items)    # the caller keeps them; later pushes must not change them
        return items

    def _open_message(self, out: list[dict[str, Any]]) -> None:
        self._start(out, {"id": _new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                          "content": []})
        assert self._open is not None
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._items[self._open]["content"].append(part)
        out.append({"type": "response.content_part.added", "item_id": self._items[self._open]["id"],
                    "output_index": self._open, "content_index": 0, "part": dict(part)})

    def _start(self, out: list[dict[str, Any]], item: dict[str, Any]) -> None:
        self._stop(out, "completed")
        self._open = len(self._items)
        self._items.append(item)
        out.append({"type": "response.output_item.added", "output_index": self._open,
                    "item": _copy(item)})

    def _stop(self, out: list[dict[str, Any]], final: Status) -> None:
        if self._open is None:
            return
        index, item = self._open, self._items[self._open]
        item["status"] = "incomplete" if final == "incomplete" else "completed"
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                out.append({"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "text": part["text"], "logprobs": []})
            else:
                out.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "text": part["text"]})
            out.append({"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)})
        else:
            out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                        "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        out.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        self._open = None


def _copy(obj: Any) -> Any:
    """A deep copy of plain JSON data (an event's item must not change as its item grows)."""
    return msgspec.json.decode(_encoder.encode(obj))
