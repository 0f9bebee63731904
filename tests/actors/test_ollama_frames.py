"""actors/http/routes/ollama_route.py's renderer: a reply with tool calls, whole or as NDJSON lines fed delta
by delta, in Ollama's shape (each call's arguments an object, the calls in one object before the final one),
whatever pieces the text comes in."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from actors.http.choice_reader import Choice
from actors.http.generation import ToolReading
from actors.http.routes.ollama_route import OllamaFrames, OllamaRenderer
from forge.messages import TextDelta, TokenCounts

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
CALLS = [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"function": {"name": "get_time", "arguments": {"zone": "CET"}}}]


def renderer(*, chat: bool = True) -> OllamaRenderer:
    return OllamaRenderer(model="m:latest", chat=chat, tools=ToolReading() if chat else None, arrival=0.0)


def ended(choice: Choice) -> Choice:
    choice.finish_reason, choice.counts = "stop", TokenCounts(prompt=5, completion=9)
    return choice


def stream(pieces: list[str], *, chat: bool = True) -> list[dict[str, Any]]:
    choice = Choice()
    frames = OllamaFrames(SimpleNamespace(choices=[choice]), renderer(chat=chat))   # type: ignore[arg-type]
    lines: list[bytes] = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        choice.text += piece
        if last:
            ended(choice)
        delta = TextDelta(request_id="r-0", text=piece, num_tokens=1, finish_reason="stop" if last else None)
        lines += frames.delta(0, delta, choice)
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)
    return [json.loads(line) for line in lines]


def test_a_whole_reply_carries_its_calls_with_object_arguments() -> None:
    choice = ended(Choice(text=TEXT))
    body = renderer().body(SimpleNamespace(choices=[choice]))        # type: ignore[arg-type]
    assert body["message"] == {"role": "assistant", "content": "Let me check.", "tool_calls": CALLS}
    assert body["done"] is True and body["done_reason"] == "stop" and body["model"] == "m:latest"
    assert (body["prompt_eval_count"], body["eval_count"]) == (5, 9)


@pytest.mark.parametrize("size", [1, 3, 7, 40, len(TEXT)])
def test_a_streamed_reply_gives_its_content_then_its_calls_then_the_end_in_any_pieces(size: int) -> None:
    objects = stream([TEXT[i:i + size] for i in range(0, len(TEXT), size)])
    *parts, calls, final = objects
    assert "".join(p["message"]["content"] for p in parts) == "Let me check."
    assert all("tool_calls" not in p["message"] and p["done"] is False for p in parts)
    assert calls["message"]["tool_calls"] == CALLS and calls["done"] is False
    assert final["done"] is True and final["message"] == {"role": "assistant", "content": ""}
    assert final["done_reason"] == "stop" and final["eval_count"] == 9


def test_generate_streams_its_text_as_response() -> None:
    objects = stream(["The capital", " is", " Paris."], chat=False)
    assert "".join(o["response"] for o in objects) == "The capital is Paris."
    assert objects[-1]["done"] is True and all(o["done"] is False for o in objects[:-1])
