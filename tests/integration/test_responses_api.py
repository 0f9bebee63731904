"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) through the official
`openai` client and the OpenAI Agents SDK against the real server and the real default model: a
response is the chat completion of the same prompt, streamed or not; structured outputs parse; a
function call round-trips; previous_response_id continues a stored conversation (from the prefix
cache); GET, DELETE and 404s; the key; a client that leaves; bodies as OpenAI's Codex CLI sends them
(namespaced functions, hosted tools declined with a warning, no max_output_tokens). Bad fields:
tests/integration/test_hostile.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import openai
import pytest

from actors.supervisor import Daemon, running_daemon
from forge.api.responses.responses_schema import DEFAULT_MAX_OUTPUT_TOKENS
from tests.integration.harness import (
    HANG_GUARD_S,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    generated_tokens,
    wait_idle,
)

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 40}}}}
KEY = "r3sponses-Key-9"


@asynccontextmanager
async def serving(daemon: Daemon, key: str = "unused") -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    async with running_daemon(daemon) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                                      timeout=HANG_GUARD_S) as client:
            yield client, url


def shared(response: Any) -> dict[str, Any]:
    """A response as two runs of the same request share it: ids (call ids too) and times are fresh, and
    the second run finds the prompt in the prefix cache (input_tokens stays, cached_tokens grows). The
    stream helper's parsed fields (parsed, parsed_arguments) are its own."""
    out = response.model_dump(exclude={"id", "created_at", "usage"})
    fresh = ("id", "call_id", "parsed_arguments")
    out["output"] = [{k: v for k, v in item.items() if k not in fresh} for item in out["output"]]
    for item in out["output"]:
        item["content"] = [{k: v for k, v in part.items() if k != "parsed"} for part in item.get("content", ())]
    usage = response.usage
    return {**out, "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}


async def test_a_response_is_the_chat_completion_of_the_same_prompt_streamed_or_not(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, url), httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            plain = await client.responses.create(model=SERVED_MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                                  max_output_tokens=24, temperature=0)
            chat = await client.chat.completions.create(model=SERVED_MODEL, max_tokens=24, temperature=0, messages=[
                {"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}])
            async with client.responses.stream(model=SERVED_MODEL, instructions=INSTRUCTIONS, input=QUESTION,
                                               max_output_tokens=24, temperature=0) as stream:
                kinds = [event.type async for event in stream]
                streamed = await stream.get_final_response()
            raw = await http.post("/v1/responses", json={"model": SERVED_MODEL, "instructions": INSTRUCTIONS,
                                                         "input": QUESTION, "max_output_tokens": 24,
                                                         "temperature": 0, "stream": True})
            short = await client.responses.create(model=SERVED_MODEL, input=QUESTION, max_output_tokens=2,
                                                  temperature=0)
            await wait_idle(daemon)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == SERVED_MODEL
    [message] = plain.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == []
    assert plain.output_text == part.text == chat.choices[0].message.content      # greedy: chat's very text
    assert "Paris" in plain.output_text
    finish = chat.choices[0].finish_reason
    assert plain.status == {"stop": "completed", "length": "incomplete"}[finish]
    assert plain.instructions == INSTRUCTIONS and plain.max_output_tokens == 24 and plain.temperature == 0
    assert plain.tools == [] and plain.tool_choice == "auto" and plain.parallel_tool_calls is True
    assert plain.store is True and plain.previous_response_id is None
    assert plain.usage is not None and chat.usage is not None
    assert plain.usage.input_tokens == chat.usage.prompt_tokens
    assert plain.usage.output_tokens == chat.usage.completion_tokens
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    assert plain.usage.output_tokens_details.reasoning_tokens == 0
    assert plain.usage.input_tokens_details.cached_tokens == 0                 # the first run of this prompt

    assert shared(streamed) == shared(plain)                                   # what the client accumulated
    assert streamed.usage is not None and streamed.usage.input_tokens_details.cached_tokens > 0
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}

    assert raw.headers["content-type"].startswith("text/event-stream")
    frames = []
    for event in (e for e in raw.content.decode().split("\n\n") if e):
        name, data = event.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), event
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")                # each frame names its type
        frames.append(payload)
    assert [f["sequence_number"] for f in frames] == list(range(len(frames)))
    assert frames[0]["response"]["status"] == "in_progress" and frames[0]["response"]["output"] == []
    assert "".join(f["delta"] for f in frames if f["type"] == "response.output_text.delta") == plain.output_text
    assert frames[-1]["response"]["output"][0]["content"][0]["text"] == plain.output_text

    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens" and short.usage is not None
    assert short.usage.output_tokens == 2 and short.output[0].status == "incomplete"  # type: ignore[union-attr]


async def test_a_json_schema_format_gives_output_that_parses(make_daemon: MakeDaemon) -> None:
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 30},
                             "country": {"type": "string", "maxLength": 30}}}
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon()) as (client, _):
            reply = await client.responses.create(
                model=SERVED_MODEL, input="Name the capital of France and its country as JSON.", temperature=0,
                max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "capital", "schema": schema, "strict": True}})
            loose = await client.responses.create(model=SERVED_MODEL, input="Describe Paris as JSON.",
                                                  temperature=0, max_output_tokens=12,
                                                  text={"format": {"type": "json_object"}})
    value = json.loads(reply.output_text)
    assert set(value) == {"city", "country"} and all(isinstance(v, str) for v in value.values())
    assert reply.text is not None and reply.text.format.type == "json_schema"
    assert isinstance(json.loads(loose.output_text), dict)                      # closed within 12 tokens


async def test_a_function_call_and_its_output_round_trip(make_daemon: MakeDaemon) -> None:
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, _):
            forced: dict[str, Any] = dict(model=SERVED_MODEL, input=question, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=60)
            call = await client.responses.create(**forced)
            async with client.responses.stream(**forced) as stream:
                kinds = [event.type async for event in stream]
                streamed = await stream.get_final_response()
            [item] = call.output
            assert item.type == "function_call"
            turn = [*question, item.model_dump(exclude_none=True),
                    {"type": "function_call_output", "call_id": item.call_id,
                     "output": '{"temperature": 21, "sky": "clear"}'}]
            answer = await client.responses.create(model=SERVED_MODEL, input=turn, tools=[WEATHER], temperature=0,
                                                   max_output_tokens=40)
            chat = await client.chat.completions.create(
                model=SERVED_MODEL, max_tokens=40, temperature=0,
                tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
                messages=[question[0], {"role": "assistant", "content": None, "tool_calls": [{
                    "id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}]},
                    {"role": "tool", "tool_call_id": item.call_id, "content": '{"temperature": 21, "sky": "clear"}'}])
            await wait_idle(daemon)
    assert call.status == "completed" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id is not None and item.id.startswith("fc_")
    assert "Oslo" in json.loads(item.arguments)["city"]
    assert call.tool_choice == "required" and call.tools[0].type == "function"
    assert shared(streamed) == shared(call)
    assert kinds[2] == "response.output_item.added" and "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert answer.output_text == (chat.choices[0].message.content or "")       # the output, seen as chat sees it


async def test_previous_response_id_continues_a_stored_conversation_from_the_cache(make_daemon: MakeDaemon) -> None:
    turns = ["My name is Ada. Say hello.", "What is my name?", "Say my name once more."]
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, url), httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            replies: list[Any] = []
            for text in turns:
                replies.append(await client.responses.create(
                    model=SERVED_MODEL, instructions=INSTRUCTIONS, input=text, temperature=0, max_output_tokens=20,
                    previous_response_id=replies[-1].id if replies else None))
            history: list[dict[str, Any]] = []
            for text, reply in zip(turns, replies, strict=True):
                history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply.output_text}]
            whole = await client.responses.create(model=SERVED_MODEL, instructions=INSTRUCTIONS, temperature=0,
                                                  max_output_tokens=20, input=history[:-1], store=False)
            chat = await client.chat.completions.create(model=SERVED_MODEL, temperature=0, max_tokens=20, messages=[
                {"role": "system", "content": INSTRUCTIONS}, *history[:-1]])   # type: ignore[list-item]
            fetched = await client.responses.retrieve(replies[1].id)
            unstored = await http.get(f"/v1/responses/{whole.id}")
            gone = await client.responses.delete(replies[0].id)
            again = await http.delete(f"/v1/responses/{replies[0].id}")
            after = await http.get(f"/v1/responses/{replies[0].id}")
            continued = await client.responses.create(
                model=SERVED_MODEL, input="Thanks.", previous_response_id=replies[2].id, max_output_tokens=4)
            with pytest.raises(openai.NotFoundError) as missing:
                await client.responses.create(model=SERVED_MODEL, input="Hi", previous_response_id=replies[0].id)
            await wait_idle(daemon)
    assert [r.previous_response_id for r in replies] == [None, replies[0].id, replies[1].id]
    assert replies[2].output_text == whole.output_text == chat.choices[0].message.content   # the same prompt
    for earlier, later in zip(replies, replies[1:], strict=False):
        assert later.usage.input_tokens > earlier.usage.input_tokens + earlier.usage.output_tokens
        assert later.usage.input_tokens_details.cached_tokens >= earlier.usage.input_tokens - 16   # the prefix hit
    assert fetched.model_dump() == replies[1].model_dump()
    assert_error(unstored, 404, code="response_not_found")
    assert gone is None or getattr(gone, "id", replies[0].id) == replies[0].id
    assert_error(again, 404)
    assert_error(after, 404, code="response_not_found")
    assert continued.status in ("completed", "incomplete")                    # the chain lives past a deleted head
    assert missing.value.status_code == 404
    assert missing.value.body["param"] == "previous_response_id"              # type: ignore[index]


async def test_an_agent_runs_its_function_tool_to_completion(make_daemon: MakeDaemon) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append(city)
        return f"It is 21 degrees and sunny in {city}."

    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon()) as (client, _):
            agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=SERVED_MODEL, openai_client=client),
                          # the first turn must call the tool; the agent then drops the requirement
                          model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=200,
                                                       parallel_tool_calls=False),
                          reset_tool_choice=True)
            result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
    assert len(seen) >= 1 and "Oslo" in seen[0]
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


async def test_the_routes_need_the_key_and_a_client_that_leaves_frees_its_request(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"api_key": KEY})
    body = {"model": SERVED_MODEL, "max_output_tokens": 400, "stream": True,
            "input": "Write a long story about the sea."}
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon, key="wrong") as (client, url):
            with pytest.raises(openai.AuthenticationError):
                await client.responses.create(model=SERVED_MODEL, input="Hi", max_output_tokens=2)
            async with httpx.AsyncClient(base_url=url, timeout=None,
                                         headers={"Authorization": f"Bearer {KEY}"}) as http:
                unkeyed = await http.get("/v1/responses/resp_x", headers={"Authorization": ""})
                async with http.stream("POST", "/v1/responses", json=body) as reply:
                    raw = b""
                    async for chunk in reply.aiter_raw():
                        raw += chunk
                        if b"event: response.output_text.delta" in raw:
                            break                                  # and leave
                assert reply.status_code == 200 and raw.startswith(b"event: response.created\n")
                await wait_idle(daemon, max_generated=generated_tokens(daemon) + 32)
                missing = await http.get("/v1/responses/resp_nonesuch")
    assert generated_tokens(daemon) < 400
    assert_error(unkeyed, 401, type="authentication_error")
    assert_error(missing, 404, code="response_not_found")


# What OpenAI's Codex CLI sends (wire_api = "responses"): its instructions, a developer message and the
# user's, its functions flat, an MCP server's in a namespace, a custom tool and hosted tools it would let
# OpenAI run, no max_output_tokens, and its other fields (store false, include, prompt_cache_key, text).
SEARCH = {"type": "function", "name": "search", "description": "Search the project's documentation.",
          "strict": False, "parameters": {"type": "object", "required": ["query"], "additionalProperties": False,
                                          "properties": {"query": {"type": "string", "maxLength": 40}}}}
DOCS = {"type": "namespace", "name": "mcp__docs__", "description": "The documentation server.", "tools": [SEARCH]}
SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command.", "strict": False,
         "parameters": {"type": "object", "required": ["command"], "additionalProperties": False,
                        "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}
HOSTED = [{"type": "custom", "name": "apply_patch", "description": "Edit files.",
           "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
          {"type": "local_shell"}, {"type": "web_search", "external_web_access": False}]


def codex_body(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "instructions": "You are a coding agent. Answer briefly.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "cwd: /src"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}],
        "tools": [SHELL, *HOSTED, DOCS], "tool_choice": "auto", "parallel_tool_calls": False,
        "store": False, "stream": True, "include": [], "prompt_cache_key": "0199-thread",
        "text": {"verbosity": "low"}, "temperature": 0, **fields}


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in (f for f in raw.decode().split("\n\n") if f):
        name, data = frame.split("\n")
        out.append(json.loads(data.removeprefix("data: ")))
        assert out[-1]["type"] == name.removeprefix("event: ")
    return out


async def test_codex_s_request_is_served_with_its_hosted_tools_declined_and_a_default_bound(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            reply = await http.post("/v1/responses", json=codex_body("Say hello."))
            await wait_idle(daemon)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    warning = reply.headers["warning"]
    assert warning.startswith('299 forge "') and all(f"tools[{i}]" in warning for i in (1, 2, 3))
    frames = events(reply.content)
    created, last = frames[0]["response"], frames[-1]["response"]
    assert frames[0]["type"] == "response.created" and frames[-1]["type"] in ("response.completed",
                                                                              "response.incomplete")
    assert [(w["param"], w["code"]) for w in created["warnings"]] == [
        ("tools[1]", "tool_not_served"), ("tools[2]", "tool_not_served"), ("tools[3]", "tool_not_served")]
    assert "'web_search'" in created["warnings"][2]["message"] and last["warnings"] == created["warnings"]
    assert [t["type"] for t in last["tools"]] == ["function", "namespace"]             # what the model was offered
    assert last["max_output_tokens"] == DEFAULT_MAX_OUTPUT_TOKENS                      # no bound sent: the default
    assert last["output"] and last["usage"]["output_tokens"] < DEFAULT_MAX_OUTPUT_TOKENS


async def test_a_namespaced_function_is_called_by_its_name_and_namespace_and_its_output_answered(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    asked = "Search the documentation for the word turns."
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            called = await http.post("/v1/responses", json=codex_body(
                asked, tools=[DOCS, *HOSTED], tool_choice="required", max_output_tokens=60))
            frames = events(called.content)
            [call] = frames[-1]["response"]["output"]
            turn = codex_body(asked, max_output_tokens=40)
            turn["input"] += [{k: v for k, v in call.items() if k not in ("id", "status")},
                              {"type": "function_call_output", "call_id": call["call_id"], "output": "No results."}]
            answered = await http.post("/v1/responses", json=turn)
            plain = await http.post("/v1/responses", json={**turn, "stream": False})
            await wait_idle(daemon)
    assert called.status_code == 200, called.text
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "search", "mcp__docs__")
    assert "query" in json.loads(call["arguments"])
    added = next(f for f in frames if f["type"] == "response.output_item.added")
    assert added["item"]["name"] == "search" and added["item"]["namespace"] == "mcp__docs__"
    assert answered.status_code == 200 and events(answered.content)[-1]["type"] in ("response.completed",
                                                                                    "response.incomplete")
    assert plain.status_code == 200 and plain.json()["output"] and "warnings" in plain.json()
