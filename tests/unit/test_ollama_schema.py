"""forge/api/ollama/: an Ollama request as the chat request it means (options, format, think, tools), what it
refuses, and its output shapes (tool calls with arguments as objects)."""

from __future__ import annotations

import json

import msgspec
import pytest

from forge.api.ollama import ollama_output as wire
from forge.api.ollama.ollama_schema import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    chat_request,
    decode_chat,
    decode_embed,
    decode_generate,
    prepare_chat,
)
from forge.errors import InvalidRequest
from forge.text.tool_reader import ToolCall

CONTEXT = 1024
HELLO = [{"role": "user", "content": "Hi"}]


def chat(**body: object) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": HELLO, **body})


def test_options_become_chats_sampling_fields_with_ollamas_defaults_where_unset() -> None:
    plain = chat_request(decode_chat(chat()), max_model_len=CONTEXT)
    assert (plain.temperature, plain.top_p, plain.top_k) == (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K)
    assert plain.stream is True and plain.max_new_tokens is None and plain.repetition_penalty == 1.0
    opts = {"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7, "num_predict": 12, "stop": "\n",
            "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "num_gpu": 99, "mirostat": 2}
    req = chat_request(decode_chat(chat(options=opts, stream=False)), max_model_len=CONTEXT)
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.seed) == (0, 0.5, 3, 0.1, 7)
    assert req.max_new_tokens == 12 and req.stop == ["\n"] and req.stream is False
    assert (req.repetition_penalty, req.presence_penalty, req.frequency_penalty) == (1.2, 0.5, -0.5)
    params = prepare_chat(decode_chat(chat(options=opts)), served_model_name="m", max_model_len=CONTEXT).params
    assert params.max_tokens == 12 and params.temperature == 0 and params.stop == ("\n",)


@pytest.mark.parametrize(("num_predict", "num_ctx", "limit"), [(-1, None, None), (-2, None, None), (5, None, 5),
                                                               (None, 256, 256), (9, 256, 9)])
def test_num_predict_bounds_the_output_and_num_ctx_does_when_it_does_not(
        num_predict: int | None, num_ctx: int | None, limit: int | None) -> None:
    opts = {k: v for k, v in (("num_predict", num_predict), ("num_ctx", num_ctx)) if v is not None}
    assert chat_request(decode_chat(chat(options=opts)), max_model_len=CONTEXT).max_new_tokens == limit


@pytest.mark.parametrize(("body", "param"), [
    (chat(options={"temperature": "hot"}), "options.temperature"),
    (chat(options={"temperature": 5}), "options.temperature"),
    (chat(options={"top_p": 0}), "options.top_p"),
    (chat(options={"num_predict": -3}), "options.num_predict"),
    (chat(messages=[{"role": "user", "content": "Hi", "images": ["aGk="]}]), "messages[0].images"),
    (chat(messages=[{"role": "user", "content": "Hi", "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages[0].tool_calls"),
    (chat(messages=[{"role": "robot", "content": "Hi"}]), "messages[0].role"),
])
def test_bad_chats_are_refused_naming_the_field(body: bytes, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        decode_chat(body)
    assert err.value.param == param


@pytest.mark.parametrize(("options", "param"), [({"num_ctx": CONTEXT + 1}, "options.num_ctx"),
                                                ({"num_predict": 0}, "options.num_predict")])
def test_limits_past_the_model_are_refused(options: dict[str, int], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat_request(decode_chat(chat(options=options)), max_model_len=CONTEXT)
    assert err.value.param == param


@pytest.mark.parametrize(("field", "value"), [("suffix", "end"), ("template", "{{ .Prompt }}"), ("context", [1, 2]),
                                              ("images", ["aGk="])])
def test_generate_refuses_what_forge_cannot_do(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        decode_generate(msgspec.json.encode({"model": "m", "prompt": "Hi", field: value}))
    assert err.value.param == field


def test_embed_refuses_empty_input() -> None:
    with pytest.raises(InvalidRequest):
        decode_embed(b'{"model": "m", "input": []}')


def test_format_is_a_json_constraint_and_think_false_closes_the_section() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer", "default": None}}}
    as_json = prepare_chat(decode_chat(chat(format="json")), served_model_name="m", max_model_len=CONTEXT)
    as_schema = prepare_chat(decode_chat(chat(format=schema)), served_model_name="m", max_model_len=CONTEXT)
    assert as_json.constraint is not None and as_json.constraint.json
    assert as_schema.constraint is not None and as_schema.request.response_format is not None
    js = as_schema.request.response_format.json_schema
    assert js is not None and js.schema == schema                      # nulls inside a schema are kept
    assert prepare_chat(decode_chat(chat(format="")), served_model_name="m", max_model_len=CONTEXT).constraint is None
    off = chat_request(decode_chat(chat(think=False)), max_model_len=CONTEXT)
    assert off.thinking_budget == 0 and off.chat_template_kwargs == {"enable_thinking": False}
    assert chat_request(decode_chat(chat(think="high")), max_model_len=CONTEXT).reasoning_effort == "high"


def test_a_tool_conversation_becomes_chats_with_ids_pairing_each_result_with_its_call() -> None:
    messages = [*HELLO,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "time", "arguments": {"zone": "CET", "when": None}}}]},
                {"role": "tool", "content": "12:00", "tool_name": "time"},
                {"role": "tool", "content": "Sunny", "tool_name": "weather"}]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("weather", "time")]
    req = chat_request(decode_chat(chat(messages=messages, tools=tools)), max_model_len=CONTEXT)
    assistant, first, second = req.messages[1:]
    assert assistant.content is None and assistant.tool_calls is not None
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in assistant.tool_calls] == [
        ("call_0", "weather", {"city": "Paris"}), ("call_1", "time", {"zone": "CET", "when": None})]
    assert (first.tool_call_id, first.name, second.tool_call_id) == ("call_1", "time", "call_0")
    assert req.tool_mode == "auto" and [t.function.name for t in req.tools or ()] == ["weather", "time"]


def test_calls_are_written_with_object_arguments_and_a_call_that_is_not_one_stays_text() -> None:
    calls, leftover = wire.tool_calls([ToolCall("call_1", "weather", '{"city": "Paris"}'), ToolCall("c", "f", "")])
    assert calls == [{"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                     {"function": {"name": "f", "arguments": {}}}] and leftover == ""
    calls, leftover = wire.tool_calls([ToolCall("c", "f", '{"city": "Par')])
    assert calls == [] and json.loads(leftover) == {"name": "f", "arguments": '{"city": "Par'}


def test_the_final_object_carries_its_reason_and_timings_in_nanoseconds() -> None:
    timings = wire.Timings(total_s=1.5, load_s=0.25, prompt_eval_s=0.5, eval_s=0.75, num_prompt_tokens=3, num_tokens=4)
    obj = wire.ended(wire.chat_object("m", content=""), wire.done_reason("length"), timings)
    assert obj["done"] is True and obj["done_reason"] == "length" and obj["message"] == {"role": "assistant",
                                                                                         "content": ""}
    assert (obj["total_duration"], obj["load_duration"], obj["prompt_eval_duration"], obj["eval_duration"]) == (
        1_500_000_000, 250_000_000, 500_000_000, 750_000_000)
    assert (obj["prompt_eval_count"], obj["eval_count"]) == (3, 4)
    assert wire.done_reason("stop") == wire.done_reason("tool_calls") == "stop"
    assert wire.ndjson_line(obj).endswith(b"}\n") and b"\n" not in wire.ndjson_line(obj)[:-1]


def test_a_format_schema_keeps_its_nulls_while_the_body_drops_them() -> None:
    body = (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "options": null,'
            b' "format": {"type": "object", "properties": {"a": {"const": null}}}}')
    req = decode_chat(body)
    assert req.format == {"type": "object", "properties": {"a": {"const": None}}}
