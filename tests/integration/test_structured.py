"""Structured outputs, tool calls and logit_bias through the official openai client, against a real daemon
serving the real model: what agent frameworks send, checked the way they check it."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import httpx
import jsonschema
import openai
import pydantic

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, PROMPT, SERVED_MODEL, MakeDaemon

# Nested objects, arrays, enums, required fields, numbers with bounds.
MOVIE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "genre": {"enum": ["drama", "comedy", "action", "documentary"]},
        "director": {"type": "object", "additionalProperties": False, "required": ["name", "born"],
                     "properties": {"name": {"type": "string", "maxLength": 30},
                                    "born": {"type": "integer", "minimum": 1850, "maximum": 2010}}},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3},
    },
    "required": ["title", "year", "rating", "genre", "director", "cast"],
    "additionalProperties": False,
}
TOPICS = ["a space adventure", "a love story in Paris", "a bank robbery", "penguins", "a chess champion",
          "a haunted house", "the first moon landing", "a cooking contest", "a detective in Tokyo",
          "a high-school band", "a volcano", "a dog who finds home", "a silent film star", "a hacker",
          "a mountain rescue", "two rival chefs", "a time traveller", "a football final", "a desert island",
          "an old lighthouse"]
# Strict (closed, every property required, as these already are): the openai client's stream helper
# parses only strict tools.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"type": "string", "maxLength": 40}}}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


class Owner(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int


class Cat(pydantic.BaseModel):
    """Arrays and strings bounded: a small model decoding greedily may repeat an item to max_tokens."""
    name: str = pydantic.Field(max_length=30)
    age: int
    colours: list[Literal["black", "white", "ginger"]] = pydantic.Field(min_length=1, max_length=3)
    owner: Owner


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=40)


@asynccontextmanager
async def serving(make_daemon: MakeDaemon) -> AsyncIterator[tuple[openai.AsyncOpenAI, str]]:
    async with running_daemon(make_daemon(max_num_seqs=32)) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                      timeout=HANG_GUARD_S) as client:
            yield client, url


def movie_request(topic: str) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "max_completion_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": f"Describe a movie about {topic} as JSON."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "movie", "schema": MOVIE, "strict": True}}}


async def test_json_schema_outputs_validate_streamed_and_not(make_daemon: MakeDaemon) -> None:
    async def plain(topic: str) -> None:
        reply = await client.chat.completions.create(**movie_request(topic))
        [choice] = reply.choices
        assert choice.finish_reason == "stop", choice.message.content
        results.append(("plain", choice.message.content or ""))

    async def streamed(topic: str) -> None:
        stream = await client.chat.completions.create(**movie_request(topic), stream=True)
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "stop"
        results.append(("stream", "".join(c.choices[0].delta.content or "" for c in chunks)))

    results: list[tuple[str, str]] = []
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with serving(make_daemon) as (client, _):
            async with anyio.create_task_group() as tg:
                for topic in TOPICS:
                    tg.start_soon(plain, topic)
                    tg.start_soon(streamed, topic)
    assert len(results) == 2 * len(TOPICS)
    for _, text in results:
        jsonschema.validate(json.loads(text), MOVIE)
    assert len({text for _, text in results}) > 5               # twenty prompts, not one canned answer


async def test_every_constraint_kind_on_both_endpoints(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as (client, _):
            obj = await client.chat.completions.create(
                model=SERVED_MODEL, max_completion_tokens=120, temperature=0, response_format={"type": "json_object"},
                messages=[{"role": "user",
                           "content": "Reply with a JSON object with the keys name and colour for a cat."}])
            choice = await client.completions.create(
                model=SERVED_MODEL, prompt="The sky is", max_tokens=8, temperature=1.0, seed=3, n=3,
                extra_body={"structured_outputs": {"choice": ["blue", "green", "on fire"]}})
            legacy = await client.completions.create(
                model=SERVED_MODEL, prompt="My phone number is", max_tokens=20, temperature=0,
                extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
            grammar = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "Is water wet?"}], temperature=0,
                max_completion_tokens=10, extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'})
            short = await client.chat.completions.create(**{**movie_request("a cat"), "max_completion_tokens": 5})
            # The client's own helpers: a Pydantic model as the response format, a Pydantic strict tool.
            parsed = await client.chat.completions.parse(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "Describe a cat and its owner."}],
                response_format=Cat, max_completion_tokens=150, temperature=0)
            called = await client.chat.completions.parse(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
                tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", temperature=0,
                parallel_tool_calls=False, max_completion_tokens=60)
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    assert [c.text for c in choice.choices] and all(c.text in ("blue", "green", "on fire") for c in choice.choices)
    assert all(c.finish_reason == "stop" for c in choice.choices)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", legacy.choices[0].text)
    assert grammar.choices[0].message.content in ("yes", "no", "maybe")
    cat = parsed.choices[0].message.parsed
    assert isinstance(cat, Cat) and 1 <= len(cat.colours) <= 3 and isinstance(cat.owner, Owner)
    [tool_call] = called.choices[0].message.tool_calls or []
    assert isinstance(tool_call.function.parsed_arguments, GetWeather)
    # The limit reached before the JSON closed: "length", as OpenAI reports it.
    assert short.choices[0].finish_reason == "length"
    assert short.usage is not None and short.usage.completion_tokens == 5


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_tool_calls_required_and_named_streamed_and_not(make_daemon: MakeDaemon) -> None:
    ask = [{"role": "user", "content": "What is the weather like in Oslo right now?"}]
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with serving(make_daemon) as (client, _):
            required = await client.chat.completions.create(
                model=SERVED_MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                max_completion_tokens=120)
            named = await client.chat.completions.create(
                model=SERVED_MODEL, messages=ask, tools=[WEATHER, TIME], temperature=0.8, seed=5,
                tool_choice={"type": "function", "function": {"name": "get_time"}}, max_completion_tokens=120)
            async with client.chat.completions.stream(
                    model=SERVED_MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                    max_completion_tokens=120) as stream:
                deltas = [event async for event in stream if event.type == "chunk"]
                streamed = await stream.get_final_completion()
            single = await client.chat.completions.create(
                model=SERVED_MODEL, messages=ask, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                parallel_tool_calls=False, max_completion_tokens=120)
    for reply in (required, named, streamed, single):
        [choice] = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert not choice.message.content
        check_calls(choice.message.tool_calls or [], {"get_weather", "get_time"})
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["get_time"]
    assert len(single.choices[0].message.tool_calls or []) == 1
    # Streamed as OpenAI does: the first chunk of a call names it, then its arguments come in pieces.
    first = [d for d in deltas if d.chunk.choices and d.chunk.choices[0].delta.tool_calls]
    head = first[0].chunk.choices[0].delta.tool_calls[0]    # type: ignore[index]
    assert head.id and head.function and head.function.name and head.function.arguments == ""
    assert len(first) > 2
    # Greedy: the stream and the plain reply agree call for call.
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls or []]


async def test_a_conversation_with_a_tool_result(make_daemon: MakeDaemon) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Oslo?"}]
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as (client, url):
            first = await client.chat.completions.create(
                model=SERVED_MODEL, messages=messages, tools=[WEATHER], tool_choice="required", temperature=0,
                parallel_tool_calls=False, max_completion_tokens=80)
            [call] = first.choices[0].message.tool_calls or []
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
            second = await client.chat.completions.create(
                model=SERVED_MODEL, messages=messages, tools=[WEATHER], temperature=0, max_completion_tokens=40)
            async with httpx.AsyncClient(base_url=url) as http:
                ids = (await http.post("/tokenize", json={"messages": messages, "tools": [WEATHER]})).json()["tokens"]
                prompt = (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]
    # The earlier call and the tool's answer reached the model, in forge's tool format.
    assert prompt.count('"name": "get_weather"') == 2           # in the tool list, and the earlier call
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in prompt


async def test_logit_bias_bans_the_greedy_token(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as (client, url):
            async with httpx.AsyncClient(base_url=url) as http:
                [paris] = (await http.post("/tokenize", json={"prompt": " Paris"})).json()["tokens"]
            plain = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=6,
                                                    temperature=0, logprobs=5)
            banned = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=6,
                                                     temperature=0, logprobs=5, logit_bias={str(paris): -100})
            chat = await client.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "The capital of France?"}], temperature=0,
                max_completion_tokens=12, logit_bias={str(paris): -100, "12": 5})
    assert plain.choices[0].text.startswith(" Paris")
    lp = banned.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.top_logprobs
    assert " Paris" not in lp.tokens
    assert all(" Paris" not in top for top in lp.top_logprobs)       # banned before logprobs too
    assert banned.choices[0].text != plain.choices[0].text
    assert chat.choices[0].finish_reason in ("stop", "length")


BAD: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "strin"}}}}}], "tool_choice": "required"}, "tools"),
]


async def test_bad_constraints_are_400_with_the_field(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url:
            async with httpx.AsyncClient(base_url=url) as http:
                for body, param in BAD:
                    reply = await http.post("/v1/chat/completions", json={
                        "model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], **body})
                    assert reply.status_code == 400, (body, reply.text)
                    error = reply.json()["error"]
                    assert error["type"] == "invalid_request_error" and error["message"]
                    assert error["param"] == param, (body, error)
                good = await http.post("/v1/chat/completions", json={
                    "model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert good.status_code == 200                           # and the daemon serves on


class LineItem(pydantic.BaseModel):
    product: str = pydantic.Field(max_length=30)
    quantity: int = pydantic.Field(ge=1, le=99)


class Invoice(pydantic.BaseModel):
    """A nested model: pydantic writes the item's schema into $defs and refers to it."""
    customer: str = pydantic.Field(max_length=30)
    items: list[LineItem] = pydantic.Field(min_length=1, max_length=3)


async def test_strict_schemas_are_closed_and_tools_keep_their_definitions(make_daemon: MakeDaemon) -> None:
    """A strict schema as pydantic writes it (no additionalProperties, optional fields listed) gets
    only its own keys, every one present, and its number ends (the model would write 31.2188...
    to the limit); a tool whose parameters use $defs compiles and its arguments validate against
    them."""
    city = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                             "country": {"type": "string", "maxLength": 30},
                                             "population_millions": {"type": "number", "minimum": 0,
                                                                     "maximum": 100}}}
    invoice_tool = {"type": "function", "function": {"name": "record_invoice", "strict": True,
                                                     "parameters": Invoice.model_json_schema()}}
    assert "$defs" in invoice_tool["function"]["parameters"]                # type: ignore[index]
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with serving(make_daemon) as (client, _):
            strict = await client.chat.completions.create(
                model=SERVED_MODEL, temperature=0, max_completion_tokens=120,
                messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": city,
                                                                        "strict": True}})
            call = await client.chat.completions.create(
                model=SERVED_MODEL, temperature=0, max_completion_tokens=200, tool_choice="required",
                messages=[{"role": "user", "content": "Record an invoice for Ann: two apples and a pear."}],
                tools=[invoice_tool])
    [choice] = strict.choices
    assert choice.finish_reason == "stop", choice.message.content
    value = json.loads(choice.message.content or "")
    assert set(value) == {"name", "country", "population_millions"}        # closed, and all required
    [tool_choice] = call.choices
    assert tool_choice.finish_reason == "tool_calls"
    made = tool_choice.message.tool_calls or []
    assert made
    for c in made:
        Invoice.model_validate_json(c.function.arguments)                 # type: ignore[union-attr]


class Person(pydantic.BaseModel):
    name: str
    age: int
    email: str | None = None


async def test_a_closing_tag_the_model_writes_inside_a_string_does_not_end_its_call(make_daemon: MakeDaemon) -> None:
    """Greedy, the default model writes '}}</tool_call>' into Person's name string and goes on with the call:
    read by the tag, its arguments were '{"name": "}' and the rest of the call content. Read by the JSON,
    the call is whole on every API and the arguments are the schema's, streamed or not."""
    person = openai.pydantic_function_tool(Person)
    request: dict[str, Any] = dict(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Extract the person: Tom is 71."}], tools=[person],
        tool_choice={"type": "function", "function": {"name": "Person"}}, temperature=0, max_completion_tokens=200)
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with serving(make_daemon) as (client, url):
            reply = await client.chat.completions.create(**request, logprobs=True)
            async with client.chat.completions.stream(**request) as stream:
                streamed = await stream.get_final_completion()
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                message = (await http.post("/v1/messages", json={
                    "model": SERVED_MODEL, "max_tokens": 200, "temperature": 0,
                    "messages": request["messages"], "tool_choice": {"type": "any"},
                    "tools": [{"name": "Person", "input_schema": person["function"]["parameters"]}]})).json()
    [choice] = reply.choices
    raw = "".join(t.token for t in choice.logprobs.content or []) if choice.logprobs else ""
    # The case itself (if the model stops writing it, find a prompt that still does): two closing tags.
    assert raw.count("</tool_call>") >= 2, raw
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), person["function"]["parameters"])
    assert isinstance(streamed.choices[0].message.tool_calls[0].function.parsed_arguments, Person)  # type: ignore[index]
    assert [c.function.arguments for c in streamed.choices[0].message.tool_calls or []] == [call.function.arguments]
    assert message["stop_reason"] == "tool_use" and {b["type"] for b in message["content"]} == {"tool_use"}
    for block in message["content"]:
        jsonschema.validate(block["input"], person["function"]["parameters"])
