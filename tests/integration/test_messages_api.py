"""The Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official `anthropic`
client against the real server and the real default model: a message is the chat completion of the
same prompt, streamed or not; tool calls round-trip; stop sequences, the length limit, the key as
x-api-key, errors in the Messages API's envelope (overload included), a client that leaves, and the
model list as the client lists it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import anyio
import httpx
import pytest
from anthropic.types import MessageParam, ToolParam

from actors.supervisor import Daemon, running_daemon
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, MakeDaemon, generated_tokens, wait_idle

QUESTION = "What is the capital of France?"
WEATHER: ToolParam = {
    "name": "get_weather", "description": "The current weather in a city.",
    "input_schema": {"type": "object", "required": ["city"], "additionalProperties": False,
                     "properties": {"city": {"type": "string", "maxLength": 40}}}}
KEY = "m3ssages-Key-7"
# The client has no sampling arguments of its own (it sends what it is given in extra_body): greedy here.
GREEDY = {"temperature": 0}


@asynccontextmanager
async def serving(daemon: Daemon, key: str = "unused") -> AsyncIterator[tuple[anthropic.AsyncAnthropic, str]]:
    async with running_daemon(daemon) as url:
        async with anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0,
                                            timeout=HANG_GUARD_S) as client:
            yield client, url


def shared(message: anthropic.types.Message) -> dict[str, Any]:
    """A message as two runs of the same request share it: ids are fresh per message and per call, and
    the second run finds the prompt in the prefix cache (input_tokens + cache_read_input_tokens stays)."""
    out = message.model_dump(exclude_none=True, exclude={"id"})
    out["content"] = [{k: v for k, v in block.items() if k not in ("id", "parsed_output")} for block in out["content"]]
    usage = out.pop("usage")
    out["prompt_tokens"] = usage.pop("input_tokens") + usage.pop("cache_read_input_tokens", 0)
    return {**out, **usage}


async def test_a_message_is_the_chat_completion_of_the_same_prompt_streamed_or_not(make_daemon: MakeDaemon) -> None:
    system, messages = "Answer in one short sentence.", [{"role": "user", "content": QUESTION}]
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, url), httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            counted = await client.messages.count_tokens(model=SERVED_MODEL, system=system, messages=messages)
            plain = await client.messages.create(model=SERVED_MODEL, max_tokens=24, extra_body=GREEDY, system=system,
                                                 messages=messages)
            chat = (await http.post("/v1/chat/completions", json={
                "model": SERVED_MODEL, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "system", "content": system}, *messages]})).json()
            raw = await http.post("/v1/messages", json={"model": SERVED_MODEL, "max_tokens": 24, "temperature": 0,
                                                         "system": system, "messages": messages, "stream": True})
            async with client.messages.stream(model=SERVED_MODEL, max_tokens=24, extra_body=GREEDY, system=system,
                                              messages=messages) as stream:
                kinds = [event.type async for event in stream]
                streamed = await stream.get_final_message()
            await wait_idle(daemon)
    assert plain.type == "message" and plain.role == "assistant" and plain.model == SERVED_MODEL
    assert plain.id.startswith("msg_")
    [block] = plain.content
    assert block.type == "text" and "Paris" in block.text
    assert block.text == chat["choices"][0]["message"]["content"]           # greedy: chat's very text
    assert plain.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert plain.stop_sequence is None
    usage = plain.usage
    assert usage.output_tokens == chat["usage"]["completion_tokens"]
    assert usage.cache_creation_input_tokens == 0
    # the whole prompt: what count_tokens says, and what chat counts
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]
    assert usage.cache_read_input_tokens == 0                                # the first run of this prompt

    assert shared(streamed) == shared(plain)                                 # what the client accumulated
    assert (streamed.usage.cache_read_input_tokens or 0) > 0                 # the same prompt again: cached

    names = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_delta",
                                       "content_block_stop", "message_delta", "message_stop")]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}

    events = [e for e in raw.content.decode().split("\n\n") if e]
    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = []
    for event in events:
        name, data = event.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), event
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")                # each frame names its type
        frames.append(payload)
    order = [f["type"] for f in frames]
    assert order[:3] == ["message_start", "content_block_start", "ping"]
    assert frames[0]["message"]["content"] == []
    assert frames[0]["message"]["usage"]["input_tokens"] == counted.input_tokens
    assert order[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(f["delta"]["text"] for f in frames if f["type"] == "content_block_delta") == block.text
    assert frames[-2]["usage"]["output_tokens"] == usage.output_tokens


async def test_a_tool_call_and_its_result_round_trip(make_daemon: MakeDaemon) -> None:
    messages: list[MessageParam] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, _):
            # tool_choice any: the output is a call (one, with parallel tool use off), whatever the model
            forced: dict[str, Any] = dict(model=SERVED_MODEL, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
                                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                          messages=messages)
            call = await client.messages.create(**forced)
            async with client.messages.stream(**forced) as stream:
                kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) async for event in stream]
                streamed = await stream.get_final_message()
            [use] = [b for b in call.content if b.type == "tool_use"]
            counted = await client.messages.count_tokens(model=SERVED_MODEL, tools=[WEATHER], messages=messages)
            bare = await client.messages.count_tokens(model=SERVED_MODEL, messages=messages)
            turn: list[MessageParam] = [
                *messages, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": '{"temperature": 21, "sky": "clear"}'}]}]
            answer = await client.messages.create(model=SERVED_MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                                                  messages=turn)
            async with httpx.AsyncClient(base_url=str(client.base_url), timeout=HANG_GUARD_S) as http:
                chat = (await http.post("/v1/chat/completions", json={
                    "model": SERVED_MODEL, "max_tokens": 40, "temperature": 0,
                    "tools": [{"type": "function", "function": {
                        "name": WEATHER["name"], "description": WEATHER.get("description"),
                        "parameters": WEATHER["input_schema"]}}],
                    "messages": [messages[0], {"role": "assistant", "content": None, "tool_calls": [{
                        "id": use.id, "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
                        {"role": "tool", "tool_call_id": use.id,
                         "content": '{"temperature": 21, "sky": "clear"}'}]})).json()
            await wait_idle(daemon)
    assert call.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.id.startswith("toolu_") and isinstance(use.input, dict) and "Oslo" in use.input["city"]
    assert shared(streamed) == shared(call)
    assert ("content_block_delta", "input_json_delta") in kinds
    assert counted.input_tokens > bare.input_tokens                           # the tools are in the prompt
    assert counted.input_tokens == call.usage.input_tokens + (call.usage.cache_read_input_tokens or 0)
    text = "".join(b.text for b in answer.content if b.type == "text")
    finish = chat["choices"][0]["finish_reason"]
    assert answer.stop_reason == {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}[finish]
    assert chat["choices"][0]["message"]["content"] == (text or None)       # the result, seen as chat sees it


async def test_stop_sequences_and_the_length_limit_say_why_the_message_ended(make_daemon: MakeDaemon) -> None:
    messages: list[MessageParam] = [{"role": "user", "content": QUESTION}]
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon()) as (client, _):
            free = await client.messages.create(model=SERVED_MODEL, max_tokens=24, extra_body=GREEDY, messages=messages)
            [block] = free.content
            assert block.type == "text" and "Paris" in block.text
            stopped = await client.messages.create(model=SERVED_MODEL, max_tokens=24, extra_body=GREEDY,
                                                   messages=messages, stop_sequences=["zzz", "Paris"])
            async with client.messages.stream(model=SERVED_MODEL, max_tokens=24, extra_body=GREEDY, messages=messages,
                                              stop_sequences=["zzz", "Paris"]) as stream:
                stopped_stream = await stream.get_final_message()
            short = await client.messages.create(model=SERVED_MODEL, max_tokens=2, extra_body=GREEDY, messages=messages)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert [b.model_dump() for b in stopped.content] == [{"type": "text", "text": block.text.split("Paris")[0],
                                                          "citations": None}]
    assert stopped_stream.stop_reason == "stop_sequence" and stopped_stream.stop_sequence == "Paris"
    assert shared(stopped_stream) == shared(stopped)
    assert short.stop_reason == "max_tokens" and short.stop_sequence is None and short.usage.output_tokens == 2
    [piece] = short.content
    assert piece.type == "text" and block.text.startswith(piece.text)


async def test_the_key_may_come_as_x_api_key(make_daemon: MakeDaemon) -> None:
    body = {"model": SERVED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon(gateway={"api_key": KEY}), key="wrong") as (client, url):
            keyed = anthropic.AsyncAnthropic(base_url=url, api_key=None, auth_token=None, max_retries=0,
                                             default_headers={"x-api-key": KEY}, timeout=HANG_GUARD_S)
            async with keyed:
                ok = await keyed.messages.create(**body)          # type: ignore[arg-type]
                counted = await keyed.messages.count_tokens(model=SERVED_MODEL, messages=body["messages"])  # type: ignore[arg-type]
            with pytest.raises(anthropic.AuthenticationError) as refused:
                await client.messages.create(**body)              # type: ignore[arg-type]
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                bearer = await http.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY}",
                                                                             "anthropic-version": "2023-06-01"})
                elsewhere = await http.post("/v1/chat/completions", headers={"x-api-key": KEY}, json={
                    "messages": body["messages"], "max_tokens": 2})
    assert ok.usage.output_tokens == 2 and counted.input_tokens > 0
    assert refused.value.status_code == 401
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "invalid or missing API key"}}
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    assert elsewhere.status_code == 401 and "error" in elsewhere.json()      # x-api-key on this route only
    assert set(elsewhere.json()["error"]) == {"message", "type", "param", "code"}


async def test_the_client_sees_bad_input_as_the_messages_api_errors(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon()) as (client, _):
            with pytest.raises(anthropic.NotFoundError) as missing:
                await client.messages.create(model="claude-nonesuch", max_tokens=4,
                                             messages=[{"role": "user", "content": "Hi"}])
            with pytest.raises(anthropic.BadRequestError) as image:
                await client.messages.create(model=SERVED_MODEL, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}}]}])
    assert missing.value.status_code == 404
    assert missing.value.body["error"]["type"] == "not_found_error"           # type: ignore[index]
    assert "claude-nonesuch" in missing.value.body["error"]["message"]        # type: ignore[index]
    assert image.value.body["error"]["type"] == "invalid_request_error"       # type: ignore[index]
    assert "messages[0].content[0]" in image.value.body["error"]["message"]   # type: ignore[index]


async def test_a_client_that_goes_away_mid_stream_frees_its_request(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    body = {"model": SERVED_MODEL, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Write a long story about the sea."}]}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            async with http.stream("POST", "/v1/messages", json=body) as reply:
                raw = b""
                async for chunk in reply.aiter_raw():
                    raw += chunk
                    if b"event: content_block_delta" in raw:
                        break                                  # and leave
            assert reply.status_code == 200 and raw.startswith(b"event: message_start\n")
            await wait_idle(daemon, max_generated=generated_tokens(daemon) + 32)
    assert generated_tokens(daemon) < 400


async def test_overload_is_a_503_overloaded_error_with_retry_after(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon(gateway={"max_waiting": 0, "retry_after_s": 7})) as (client, url):
            with pytest.raises(anthropic.APIStatusError) as refused:
                await client.messages.create(model=SERVED_MODEL, max_tokens=4,
                                             messages=[{"role": "user", "content": "Hi"}])
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                counted = await http.post("/v1/messages/count_tokens", json={
                    "model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "7"
    assert refused.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                             "message": "the server is overloaded; retry later"}}
    assert counted.status_code == 200                            # counting runs nothing: not admitted


async def test_the_model_list_answers_anthropics_client_in_its_shape(make_daemon: MakeDaemon) -> None:
    """GET /v1/models with anthropic-version (as the `anthropic` client sends it) is the Models API's
    list, keyed by x-api-key, its errors in that API's envelope; without the header, OpenAI's list."""
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon(gateway={"api_key": KEY}), key=KEY) as (client, url):
            listed = [model async for model in client.models.list()]
            page = await client.models.list(limit=1)
            one = await client.models.retrieve(SERVED_MODEL)
            with pytest.raises(anthropic.NotFoundError) as missing:
                await client.models.retrieve("claude-nonesuch")
            with pytest.raises(anthropic.BadRequestError) as bad_limit:
                await client.models.list(limit=0)
            version = {"anthropic-version": "2023-06-01"}
            bearer = {"Authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                raw = await http.get("/v1/models", headers={"x-api-key": KEY, **version})
                openai_shape = await http.get("/v1/models", headers=bearer)
                openai_one = await http.get(f"/v1/models/{SERVED_MODEL}", headers=bearer)
                unkeyed = await http.get("/v1/models", headers={"x-api-key": "wrong", **version})
    assert [m.id for m in listed] == [SERVED_MODEL] and listed[0].type == "model"
    assert listed[0].display_name == SERVED_MODEL and listed[0].created_at.year == 1970   # release date not known
    assert listed[0].max_input_tokens == listed[0].max_tokens == 1024                     # the context served
    assert page.data == listed and page.has_more is False
    assert page.first_id == page.last_id == SERVED_MODEL
    assert one == listed[0]
    assert missing.value.body["error"]["type"] == "not_found_error"                       # type: ignore[index]
    assert bad_limit.value.body["error"]["type"] == "invalid_request_error"               # type: ignore[index]
    assert raw.json() == {"data": [listed[0].model_dump(mode="json", exclude_none=True) | {
        "created_at": "1970-01-01T00:00:00Z"}], "has_more": False, "first_id": SERVED_MODEL, "last_id": SERVED_MODEL}
    assert openai_shape.json()["object"] == "list" and openai_shape.json()["data"][0]["object"] == "model"
    assert openai_shape.json()["data"][0]["id"] == SERVED_MODEL and openai_shape.json()["data"][0]["state"] == "loaded"
    assert openai_one.json() == openai_shape.json()["data"][0]
    assert unkeyed.status_code == 401 and unkeyed.json()["type"] == "error"             # Anthropic's envelope
