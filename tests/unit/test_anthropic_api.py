"""The Messages API's wire format: its decoding (a 400 naming the field for anything wrong), the chat
request it means (the same preparation as chat's equivalent body), and its response shapes (a stream
that accumulates to the body)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from forge.api.anthropic import anthropic_output as wire
from forge.api.anthropic.anthropic_schema import chat_request, decode_count_tokens, decode_messages, prepare_messages
from forge.api.openai.openai_prepare import prepare_chat
from forge.api.openai.openai_schema import NamedToolChoice
from forge.api.sse import sse_event
from forge.errors import InvalidRequest
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolCallReader

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
USER = [{"role": "user", "content": "Hi"}]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 8, "messages": USER, **fields}).encode()


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": [{"role": "bot", "content": "Hi"}]}, "messages[0].role"),
    ({"messages": []}, "messages"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "document"}]}]}]},
     "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                   *USER]}, "messages[1].content[0]"),
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is"}]}, "messages[1].role"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"output_config": {"format": {"type": "xml", "schema": {}}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": {}},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"}, "output_format": {"type": "json_schema", "schema": {}}},
     "tool_choice"),
])
def test_a_bad_field_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    raw = json.loads(body())
    raw.update(fields)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(InvalidRequest) as refused:
        decode_messages(json.dumps(raw).encode())
    assert refused.value.param == param, refused.value.message
    assert wire.error_body(400, refused.value.message, param)["error"]["message"].count(param) >= 1


def test_unknown_fields_are_ignored_and_nulls_are_absent_as_on_every_route() -> None:
    req = decode_messages(body(metadata={"user_id": "u"}, thinking={"type": "enabled"}, top_k=None,
                               service_tier="auto", messages=[{"role": "user", "content": [
                                   {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]))
    assert req.top_k == 0 and req.temperature == 1.0 and not req.stream
    assert decode_count_tokens(b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}').system is None


def test_a_conversation_with_tools_is_the_chat_request_it_means() -> None:
    req = decode_messages(body(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=40,
        messages=[{"role": "user", "content": "Weather in Oslo and Rome?"},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "Checking."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                      {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 C"},
                      {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                       "content": [{"type": "text", "text": "no data"}]},
                      {"type": "text", "text": "And tomorrow?"}]}]))
    chat = chat_request(req)
    assert [(m.role, m.content if isinstance(m.content, str | None) else [p.text for p in m.content],
             m.tool_call_id) for m in chat.messages] == [
        ("system", ["Be brief.", "Use tools."], None), ("user", "Weather in Oslo and Rome?", None),
        ("assistant", ["Checking."], None), ("tool", "12 C", "toolu_1"), ("tool", "Error: no data", "toolu_2"),
        ("user", ["And tomorrow?"], None)]
    calls = chat.messages[2].tool_calls or []
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("toolu_1", "get_weather", {"city": "Oslo"}), ("toolu_2", "get_weather", {"city": "Rome"})]
    [tool] = chat.tools or []
    assert (tool.function.name, tool.function.parameters) == ("get_weather", WEATHER["input_schema"])
    assert chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    assert (chat.max_new_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop) == (8, 0.5, 0.9, 40, ["\n\n"])


@pytest.mark.parametrize(("choice", "mode"), [
    (None, "auto"), ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, "get_weather")])
def test_tool_choice_maps_onto_chats(choice: dict[str, Any] | None, mode: str) -> None:
    chat = chat_request(decode_messages(body(tools=[WEATHER], **({"tool_choice": choice} if choice else {}))))
    assert chat.tool_mode == mode and chat.parallel_tool_calls
    if mode == "get_weather":
        assert isinstance(chat.tool_choice, NamedToolChoice)


def test_a_message_prepares_exactly_as_the_equivalent_chat_request() -> None:
    """Same sampling params (the constraint's grammar included), template messages and functions."""
    _, prep = prepare_messages(body(system="Be brief.", tools=[WEATHER], tool_choice={"type": "any"},
                                    temperature=0, stop_sequences=["END"]),
                               served_model_name="m", max_model_len=1024)
    chat = prepare_chat(json.dumps({
        "model": "m", "max_tokens": 8, "temperature": 0, "stop": ["END"], "tool_choice": "required",
        "messages": [{"role": "system", "content": "Be brief."}, *USER],
        "tools": [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                    "parameters": WEATHER["input_schema"]}}]}).encode(),
        served_model_name="m", max_model_len=1024)
    assert prep.params == chat.params and prep.params.grammar is not None
    assert (prep.messages, prep.functions, prep.constraint) == (chat.messages, chat.functions, chat.constraint)


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("fields", [
    {"output_config": {"format": {"type": "json_schema", "schema": CITY}, "effort": "low"}},
    {"output_format": {"type": "json_schema", "schema": CITY}},          # the structured-outputs beta's name
])
def test_an_output_format_constrains_the_text_as_chats_json_schema(fields: dict[str, Any]) -> None:
    """Structured outputs (what the SDKs' messages.parse sends): the same grammar as chat's response_format
    json_schema with the schema as given."""
    _, prep = prepare_messages(body(temperature=0, **fields), served_model_name="m", max_model_len=1024)
    chat = prepare_chat(json.dumps({
        "model": "m", "max_tokens": 8, "temperature": 0, "messages": USER,
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": CITY}}}).encode(),
        served_model_name="m", max_model_len=1024)
    assert prep.params == chat.params and prep.params.grammar is not None
    assert prep.constraint is not None and chat.constraint is not None and prep.constraint.json
    assert prep.constraint.grammar == chat.constraint.grammar and prep.messages == chat.messages
    assert prep.constraint.param in {"output_config.format.schema", "output_format.schema"}
    assert chat_request(decode_messages(body(output_config={"effort": "low"}))).response_format is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": {}}}, "output_format.schema")])
def test_a_bad_output_schema_is_refused_by_the_messages_field(fields: dict[str, Any], param: str) -> None:
    """Refused while preparing (nested too deep) or later, compiled against the vocabulary (an unknown
    type): either way the 400 names the Messages field, not chat's response_format."""
    def given(schema: dict[str, Any]) -> dict[str, Any]:
        [where] = fields
        fmt = {"type": "json_schema", "schema": schema}
        return {where: {"format": fmt} if where == "output_config" else fmt}

    deep: dict[str, Any] = {"type": "object"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequest) as refused:
        prepare_messages(body(**given(deep)), served_model_name="m", max_model_len=1024)
    assert refused.value.param == param, refused.value.message
    _, prep = prepare_messages(body(**given({"type": "object", "properties": {"a": {"type": "nonsense"}}})),
                               served_model_name="m", max_model_len=1024)
    assert prep.constraint is not None and prep.constraint.param == param


# ---- responses ------------------------------------------------------------------------------------------

def accumulate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's content as a client builds it: blocks opened, text appended, input JSON parsed at the end."""
    blocks: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}
    open_block = None
    for e in events:
        if e["type"] == "content_block_start":
            assert open_block is None and e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
            open_block = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_block
            if e["delta"]["type"] == "text_delta":
                blocks[e["index"]]["text"] += e["delta"]["text"]
            else:
                inputs[e["index"]] = inputs.get(e["index"], "") + e["delta"]["partial_json"]
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_block
            open_block = None
    assert open_block is None
    for i, text in inputs.items():
        blocks[i]["input"] = json.loads(text)
    return blocks


TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\nDone.')


@pytest.mark.parametrize("step", [1, 3, 7, len(TEXT)])
def test_the_stream_accumulates_to_the_body_however_the_text_comes(step: int) -> None:
    whole = wire.ContentBlocks()
    whole.push(wire.text_events(ToolCallReader(), TEXT, final=True))
    whole.close()
    streamed, calls, events = wire.ContentBlocks(), ToolCallReader(), []
    pieces = [TEXT[i:i + step] for i in range(0, len(TEXT), step)]
    for k, piece in enumerate(pieces):
        events += streamed.push(wire.text_events(calls, piece, final=k == len(pieces) - 1))
    events += streamed.close()
    content = whole.content()
    assert [b["type"] for b in content] == ["text", "tool_use", "tool_use", "text"]
    assert content[0]["text"] == "Let me look." and content[3]["text"] == "\nDone."
    assert [b["input"] for b in content[1:3]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert all(b["id"].startswith("toolu_") and b["name"] == "get_weather" for b in content[1:3])
    ids = lambda blocks: [{k: v for k, v in b.items() if k != "id"} for b in blocks]  # noqa: E731
    assert ids(accumulate(events)) == ids(content) == ids(streamed.content())
    assert whole.has_tool_use and streamed.has_tool_use


def test_blocks_without_tools_are_the_text_and_nothing_is_an_empty_message() -> None:
    blocks = wire.ContentBlocks()
    events = blocks.push(wire.text_events(None, "<tool_call> is just text", final=True)) + blocks.close()
    assert blocks.content() == [{"type": "text", "text": "<tool_call> is just text"}]
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    empty = wire.ContentBlocks()
    assert empty.push(wire.text_events(None, "", final=True)) + empty.close() == [] and empty.content() == []


def test_a_call_cut_short_has_the_input_it_can_read() -> None:
    blocks = wire.ContentBlocks()
    blocks.push([CallStart(0, "call_1", "f"), ArgumentsDelta(0, '{"city": "Os'), ContentDelta("")])
    blocks.close()
    assert blocks.content() == [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]


@pytest.mark.parametrize(("finish", "stop_string", "has_tool_use", "reason"), [
    ("stop", None, False, "end_turn"), ("stop", None, True, "tool_use"), ("stop", "END", False, "stop_sequence"),
    ("stop", "END", True, "stop_sequence"), ("length", None, True, "max_tokens"), (None, None, False, "max_tokens")])
def test_stop_reasons(finish: str | None, stop_string: str | None, has_tool_use: bool, reason: str) -> None:
    assert wire.stop_reason(finish, stop_string, has_tool_use=has_tool_use) == reason


def test_usage_counts_input_apart_from_the_cache() -> None:
    assert wire.usage(prompt_tokens=40, cached_tokens=32, output_tokens=5) == {
        "input_tokens": 8, "output_tokens": 5, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32}


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (503, "overloaded_error"), (500, "api_error"),
    (502, "api_error"), (422, "invalid_request_error")])
def test_errors_take_the_type_of_their_status(status: int, kind: str) -> None:
    assert wire.error_body(status, "no") == {"type": "error", "error": {"type": kind, "message": "no"}}
    assert wire.error_body(status, "must be at most 1", "temperature")["error"]["message"] == (
        "temperature: must be at most 1")
    assert wire.error_body(status, "invalid 'top_k': bad", "top_k")["error"]["message"] == "invalid 'top_k': bad"


def test_every_event_is_named_by_its_type() -> None:
    frame = sse_event(wire.message_delta(stop_reason="end_turn", stop_sequence=None,
                                              usage=wire.usage(prompt_tokens=3, cached_tokens=0, output_tokens=1)))
    name, data, end = frame.split(b"\n", 2)
    assert name == b"event: message_delta" and json.loads(data.removeprefix(b"data: "))["type"] == "message_delta"
    assert end == b"\n" and wire.PING == b'event: ping\ndata: {"type":"ping"}\n\n'
    start = wire.message_start(message_id="msg_1", model="m", input_tokens=7)
    assert start["message"]["content"] == [] and start["message"]["usage"]["input_tokens"] == 7


def test_thinking_is_chats_budget_and_thinking_blocks_are_left_out_of_the_prompt() -> None:
    enabled = chat_request(decode_messages(body(thinking={"type": "enabled", "budget_tokens": 64})))
    assert enabled.thinking_budget == 64 and enabled.chat_template_kwargs is None
    disabled = chat_request(decode_messages(body(thinking={"type": "disabled"})))
    assert disabled.thinking_budget == 0 and disabled.chat_template_kwargs == {"enable_thinking": False}
    assert chat_request(decode_messages(body())).thinking_budget is None
    _, prep = prepare_messages(body(thinking={"type": "enabled", "budget_tokens": 5}, messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": ""},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"}]), served_model_name="m", max_model_len=64)
    assert prep.thinking_budget == 5
    assert [m["content"] for m in prep.messages] == ["Hi", "Hello!", "Bye"]
    # a ThinkingDelta opens a thinking block; text after it opens a text block
    blocks = wire.ContentBlocks()
    events = blocks.push([wire.ThinkingDelta("Hmm."), ContentDelta("Hi.")]) + blocks.close()
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_stop",
                                           "content_block_start", "content_block_delta", "content_block_stop"]
    assert events[1]["delta"] == {"type": "thinking_delta", "thinking": "Hmm."}
    assert blocks.content() == [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                {"type": "text", "text": "Hi."}]


def test_the_model_list_pages_as_the_models_api_does() -> None:
    infos = [wire.model_info(name, max_model_len=None) for name in "abcde"]

    def ids(page: dict[str, Any]) -> tuple[list[str], bool, str | None, str | None]:
        return [m["id"] for m in page["data"]], page["has_more"], page["first_id"], page["last_id"]

    assert ids(wire.model_page(infos)) == (list("abcde"), False, "a", "e")
    assert ids(wire.model_page(infos, limit=2)) == (["a", "b"], True, "a", "b")
    assert ids(wire.model_page(infos, limit=2, after_id="b")) == (["c", "d"], True, "c", "d")
    assert ids(wire.model_page(infos, limit=2, after_id="d")) == (["e"], False, "e", "e")
    assert ids(wire.model_page(infos, limit=2, before_id="d")) == (["b", "c"], True, "b", "c")
    assert ids(wire.model_page(infos, after_id="e")) == ([], False, None, None)
    assert infos[0] == {"type": "model", "id": "a", "display_name": "a", "created_at": "1970-01-01T00:00:00Z",
                        "lifecycle": "active", "max_input_tokens": None, "max_tokens": None}
    with pytest.raises(ValueError):
        wire.model_page(infos, after_id="z")
