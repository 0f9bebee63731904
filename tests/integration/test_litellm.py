"""litellm against forge (issue 55): the real `litellm` at the version pinned in the test extra, through its
`openai/` provider on /v1 (chat, stream, a forced tool call, a json_schema response_format, the Responses API
plain and streamed, embeddings of all-MiniLM-L6-v2 served beside the default model) and its `anthropic/`
provider on /v1/messages (plain, stream, a forced tool use, and litellm's own Messages API), against a real
daemon serving the real models.

litellm reaches nothing else: set before it is imported, LITELLM_LOCAL_MODEL_COST_MAP reads its model cost map
from the package (it fetches the map on import otherwise) and LITELLM_OFFLINE_MODE has it use its bundled copy of
anything else it would fetch on its own (its Anthropic beta-header table). It sends no telemetry of its own.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_OFFLINE_MODE"] = "true"

import anyio  # noqa: E402
import jsonschema  # noqa: E402
import litellm  # noqa: E402
import pytest  # noqa: E402

from actors.http.gateway import GatewayConfig  # noqa: E402
from actors.runtime.model_set import ModelEntry  # noqa: E402
from actors.supervisor import Daemon, DaemonConfig, running_daemon  # noqa: E402
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, MakeDaemon, engine_config  # noqa: E402

# litellm's own modules, imported on its first call, build pydantic adapters over TypedDicts with ReadOnly items
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")
ASK = [{"role": "user", "content": "Say hello in one short sentence."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER_SCHEMA}}
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}
ENDS = {"stop", "length"}


def openai_args(url: str, model: str = SERVED_MODEL) -> dict[str, Any]:
    return {"model": f"openai/{model}", "api_base": f"{url}/v1", "api_key": "unused"}


def anthropic_args(url: str) -> dict[str, Any]:
    return {"model": f"anthropic/{SERVED_MODEL}", "api_base": url, "api_key": "unused"}


async def streamed(stream: Any) -> tuple[str, list[Any], str | None]:
    """A litellm stream read to its end: the text, the tool call deltas, and the finish reason."""
    text, calls, finish = "", [], None
    async for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        calls.extend(choice.delta.tool_calls or [])
        finish = choice.finish_reason or finish
    return text, calls, finish


def weather_call(call: Any) -> dict[str, Any]:
    assert call.function.name == "get_weather", call
    args: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    return args


async def test_litellm_openai_provider(default_model_path: Path, minilm_model_dir: Path) -> None:
    models = [ModelEntry(model_id=SERVED_MODEL, source=str(default_model_path)),
              ModelEntry(model_id="minilm", source=str(minilm_model_dir))]
    daemon = Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20), gateway=GatewayConfig(),
                                 models=models, drain_timeout=5.0))
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            args = openai_args(url)
            plain = await litellm.acompletion(**args, messages=ASK, max_tokens=24, temperature=0)
            text, _, finish = await streamed(await litellm.acompletion(
                **args, messages=ASK, max_tokens=24, temperature=0, stream=True))
            called = await litellm.acompletion(
                **args, messages=WEATHER_ASK, tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            _, call_deltas, call_finish = await streamed(await litellm.acompletion(
                **args, messages=WEATHER_ASK, tools=[WEATHER_TOOL], max_tokens=48, temperature=0, stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}))
            city = await litellm.acompletion(
                **args, messages=[{"role": "user", "content": "A city and its population, as JSON."}],
                max_tokens=64, temperature=0,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
            response = await litellm.aresponses(**args, input="Say hi.", max_output_tokens=32, temperature=0)
            response_events = [event async for event in await litellm.aresponses(
                **args, input="Say hi.", max_output_tokens=32, temperature=0, stream=True)]
            embedded = await litellm.aembedding(**openai_args(url, "minilm"), input=["The cat sat.", "A kitten."])

    assert plain.model.endswith(SERVED_MODEL) and plain.choices[0].finish_reason in ENDS, plain
    assert plain.choices[0].message.content.strip(), plain
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens > 0, plain.usage
    assert text.strip() and finish in ENDS, (text, finish)

    assert called.choices[0].finish_reason == "tool_calls", called
    [call] = called.choices[0].message.tool_calls
    assert call.id and call.type == "function", call
    weather_call(call)
    assert call_finish == "tool_calls" and call_deltas, call_deltas
    arguments = "".join(delta.function.arguments or "" for delta in call_deltas)
    assert call_deltas[0].function.name == "get_weather" and call_deltas[0].id, call_deltas[0]
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)

    assert city.choices[0].finish_reason == "stop", city
    jsonschema.validate(json.loads(city.choices[0].message.content), CITY_SCHEMA)

    # litellm.aresponses: the Responses API through litellm; greedy, the stream is the same response
    assert response.status in {"completed", "incomplete"} and response.output_text.strip(), response
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0, response.usage
    final = response_events[-1].response        # litellm labels forge's response.incomplete event "completed" too
    deltas = "".join(event.delta for event in response_events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == response.output_text and final.status == response.status, final

    assert [item["index"] for item in embedded.data] == [0, 1], embedded
    assert len(embedded.data[0]["embedding"]) == len(embedded.data[1]["embedding"]) == 384, embedded
    assert embedded.usage.prompt_tokens > 0, embedded.usage


async def test_litellm_anthropic_provider(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url:
            args = anthropic_args(url)
            plain = await litellm.acompletion(**args, messages=ASK, max_tokens=24, temperature=0)
            text, _, finish = await streamed(await litellm.acompletion(
                **args, messages=ASK, max_tokens=24, temperature=0, stream=True))
            called = await litellm.acompletion(
                **args, messages=WEATHER_ASK, tools=[WEATHER_TOOL], max_tokens=48, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
            _, call_deltas, call_finish = await streamed(await litellm.acompletion(
                **args, messages=WEATHER_ASK, tools=[WEATHER_TOOL], max_tokens=48, temperature=0, stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}))
            passed_through = await litellm.anthropic.messages.acreate(   # litellm's Messages API, as it is
                **args, messages=ASK, max_tokens=24, temperature=0)

    # litellm maps the Messages API's stop_reason (end_turn, max_tokens, tool_use) to chat's finish_reason
    assert plain.choices[0].finish_reason in ENDS and plain.choices[0].message.content.strip(), plain
    assert plain.usage.prompt_tokens > 0 and plain.usage.completion_tokens > 0, plain.usage
    assert text.strip() and finish in ENDS, (text, finish)

    assert called.choices[0].finish_reason == "tool_calls", called
    [call] = called.choices[0].message.tool_calls
    assert call.id, call
    weather_call(call)
    assert call_finish == "tool_calls" and call_deltas, call_deltas
    arguments = "".join(delta.function.arguments or "" for delta in call_deltas)
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)

    assert passed_through["type"] == "message" and passed_through["model"] == SERVED_MODEL, passed_through
    assert passed_through["stop_reason"] in {"end_turn", "max_tokens"}, passed_through
    assert [block["type"] for block in passed_through["content"]] == ["text"], passed_through
    assert passed_through["content"][0]["text"].strip() and passed_through["usage"]["output_tokens"] > 0
