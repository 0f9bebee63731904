"""Ollama's response shapes: chat and generate objects (one per NDJSON line when streamed, the last with
`done: true`, its reason and its timings in nanoseconds), tool calls with their arguments as objects, the
model list entries of /api/tags and /api/ps, /api/show's body, and the error object. Pure: no I/O.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec

from forge.text.tool_reader import ToolCall

NDJSON = "application/x-ndjson"
# The Ollama version forge's API follows (what /api/version reports, so that apps that check for a version
# with the routes they use accept forge); forge's own version is beside it.
OLLAMA_API_VERSION = "0.12.0"
# What a stream sends while nothing comes for a while (a long prefill): a space, which a line reader joins
# to the next line, and JSON allows before a value; an empty line would not parse.
NDJSON_PING = b" "

DoneReason = Literal["stop", "length", "load", "unload"]
_json = msgspec.json.Encoder()


def ndjson_line(obj: dict[str, Any]) -> bytes:
    return _json.encode(obj) + b"\n"


def created_at(unix_s: float | None = None) -> str:
    """RFC 3339 in UTC with microseconds, as Ollama writes `created_at`."""
    stamp = datetime.fromtimestamp(time.time() if unix_s is None else unix_s, tz=UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def error_body(message: str) -> dict[str, str]:
    return {"error": message}


def done_reason(finish_reason: str | None) -> DoneReason:
    """forge's finish reason as Ollama's: a length cut is "length", everything else ("stop", "tool_calls")
    "stop"."""
    return "length" if finish_reason in (None, "length") else "stop"


@dataclass(frozen=True, slots=True)
class Timings:
    """A response's figures in Ollama's final object: seconds here, nanoseconds on the wire."""
    total_s: float
    load_s: float                       # waiting for the model's load (or its turn)
    prompt_eval_s: float                # from admission to the first token
    eval_s: float                       # from the first token to the last
    num_prompt_tokens: int
    num_tokens: int

    def fields(self) -> dict[str, int]:
        ns = 1_000_000_000
        return {"total_duration": int(self.total_s * ns), "load_duration": int(self.load_s * ns),
                "prompt_eval_count": self.num_prompt_tokens, "prompt_eval_duration": int(self.prompt_eval_s * ns),
                "eval_count": self.num_tokens, "eval_duration": int(self.eval_s * ns)}


def chat_object(model: str, *, content: str, thinking: str = "", calls: list[dict[str, Any]] | None = None,
                done: bool = False) -> dict[str, Any]:
    """One /api/chat object: the message so far (streamed: this line's part of it)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return {"model": model, "created_at": created_at(), "message": message, "done": done}


def generate_object(model: str, *, response: str, thinking: str = "", done: bool = False) -> dict[str, Any]:
    """One /api/generate object."""
    out: dict[str, Any] = {"model": model, "created_at": created_at(), "response": response, "done": done}
    if thinking:
        out["thinking"] = thinking
    return out


def ended(obj: dict[str, Any], reason: DoneReason, timings: Timings | None) -> dict[str, Any]:
    """The object marked as the last: done, its reason, its timings."""
    obj.update(done=True, done_reason=reason)
    if timings is not None:
        obj.update(timings.fields())
    return obj


def tool_calls(calls: list[ToolCall]) -> tuple[list[dict[str, Any]], str]:
    """Calls in Ollama's shape, their arguments as objects; a call whose arguments are not a JSON object
    (the model wrote something else) is given back as text, for the content, rather than made up."""
    out, leftover = [], []
    for call in calls:
        try:
            arguments = json.loads(call.arguments or "{}")
        except (ValueError, RecursionError):
            arguments = None
        if isinstance(arguments, dict):
            out.append({"function": {"name": call.name, "arguments": arguments}})
        else:
            leftover.append(json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False))
    return out, "\n".join(leftover)


def embed_body(model: str, vectors: list[list[float]], timings: Timings) -> dict[str, Any]:
    fields = timings.fields()
    return {"model": model, "embeddings": vectors, "total_duration": fields["total_duration"],
            "load_duration": fields["load_duration"], "prompt_eval_count": timings.num_prompt_tokens}
