"""Tool calls: forge's prompt format for templates without tool syntax, the call grammar, and reading calls
back out of generated text whole or in any pieces."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.config import EngineConfig
from forge.llm import LLM
from forge.sampling.sampling_params import SamplingParams
from forge.text.chat_template import ChatTemplate
from forge.text.tool_calls import Function, messages_with_tools, tool_call_grammar
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolCallReader, ToolEvent, read_message

WEATHER = Function("get_weather", "The weather in a city.",
                   {"type": "object", "required": ["city"], "additionalProperties": False,
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}})
TIME = Function("get_time", None, {"type": "object", "required": ["zone"], "additionalProperties": False,
                                   "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}})


def call(name: str, args: object) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def test_read_message_splits_content_and_calls() -> None:
    text = "Let me check.\n" + call("get_weather", {"city": "Oslo", "n": {"a": [1, 2]}}) + "\n" + call("get_time", {})
    msg = read_message(text)
    assert msg.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Oslo", "n": {"a": [1, 2]}}), ("get_time", {})]
    assert len({c.id for c in msg.tool_calls}) == 2 and all(c.id.startswith("call_") for c in msg.tool_calls)
    assert read_message(call("f", {"x": 1})).content is None
    assert read_message("plain text").tool_calls == []
    # Keys in another order, or compact JSON: still a call, read at the block's end.
    msg = read_message('<tool_call>{"arguments":{"x":1},"name":"g"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == [("g", {"x": 1})]
    # Not a call: kept as content, nothing lost.
    assert read_message("<tool_call>\nhello\n</tool_call>").content == "<tool_call>\nhello\n</tool_call>"
    # Cut short by max_tokens: the call keeps the arguments it has.
    [cut] = read_message('<tool_call>\n{"name": "f", "arguments": {"city": "Os').tool_calls
    assert (cut.name, cut.arguments) == ("f", '{"city": "Os')
    # parallel_tool_calls=false: the first call only.
    assert len(read_message(call("a", {}) + "\n" + call("b", {}), max_calls=1).tool_calls) == 1


def joined(events: list[ToolEvent]) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls)
            calls.append([e.name, ""])
        elif isinstance(e, ArgumentsDelta):
            calls[e.index][1] += e.text
    return content, [(name, args) for name, args in calls]


pieces = st.sampled_from([
    "Sure. ", "  ", "\n", "<tool", "_call>", call("get_weather", {"city": "Paris \"x\" }"}), "</tool_call>",
    call("get_time", {"zone": "UTC"}), '<tool_call>\n{"name": "f", "arguments": {"a": {"b": "}"}}}',
    '<tool_call>{"arguments": {}, "name": "h"}</tool_call>', "text with } brace", "<tool_call>\nbad\n",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(pieces, max_size=6), st.data())
def test_reading_in_pieces_gives_what_reading_whole_gives(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    whole = ToolCallReader()
    expected = joined(whole.push(text) + whole.finish())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    reader, events, start = ToolCallReader(), [], 0
    for cut in [*cuts, len(text)]:
        events += reader.push(text[start:cut])
        start = cut
    events += reader.finish()
    assert joined(events) == expected
    # Arguments sent before a call ends never hold its closing brace or tag.
    for e in events:
        if isinstance(e, ArgumentsDelta):
            assert "</tool_call>" not in e.text


@pytest.mark.parametrize("in_pieces", [False, True])
def test_a_call_cut_short_keeps_its_arguments_and_nothing_of_the_call_around_them(in_pieces: bool) -> None:
    """The length limit may end the text anywhere in a call: what it read of the arguments is a prefix of
    them, never the call's own closing brace nor the start of its closing tag."""
    arguments = json.dumps({"city": "Oslo", "n": {"a": "}"}})
    text = call("get_weather", {"city": "Oslo", "n": {"a": "}"}})
    start = text.index(arguments)
    for end in range(start, len(text) + 1):
        reader = ToolCallReader()
        pieces = [text[i:i + 3] for i in range(0, end, 3)] if in_pieces else [text[:end]]
        events = [e for piece in pieces for e in reader.push(piece)] + reader.finish()
        [(name, got)] = joined(events)[1]
        assert name == "get_weather" and arguments.startswith(got), (text[:end], got)
        if end >= start + len(arguments):
            assert got == arguments, (text[:end], got)


def test_streamed_arguments_come_in_pieces_after_the_name() -> None:
    reader = ToolCallReader()
    text = call("get_weather", {"city": "Oslo", "days": 3})
    events = [e for i in range(0, len(text), 4) for e in reader.push(text[i:i + 4])] + reader.finish()
    assert isinstance(events[0], CallStart) and events[0].name == "get_weather"
    args = [e for e in events if isinstance(e, ArgumentsDelta)]
    assert len(args) > 3 and json.loads("".join(e.text for e in args)) == {"city": "Oslo", "days": 3}


def test_messages_with_tools_use_forges_format() -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
                {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
                {"role": "tool", "content": "12:00", "tool_call_id": "c2"}]
    out = messages_with_tools(messages, [WEATHER, TIME])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in out[0]["content"]
    assert read_message(out[2]["content"]).tool_calls[1].arguments == '{"zone": "CET"}'
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
    assert messages_with_tools([{"role": "user", "content": "x"}], [TIME])[0]["role"] == "system"
    assert messages_with_tools([{"role": "user", "content": "x"}], []) == [{"role": "user", "content": "x"}]
    assert not ChatTemplate(None).supports_tools
    assert ChatTemplate("{% if tools %}{{ tools | tojson }}{% endif %}").render(
        [{"role": "user", "content": "x"}], tools=[WEATHER.as_tool()]).startswith('[{"type": "function"')


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> LLM:
    # float32 K/V: the sampled runs below (up to temperature 1.2) close their calls within 120
    # tokens on this trajectory; the grammar does not yet bound a call's length, so another
    # trajectory (float16's) may ramble past max_tokens inside a string
    return LLM(default_model_path, EngineConfig(kv_cache_dtype="float32"), progress=lambda message: None)


@pytest.mark.parametrize("parallel", [False, True])
def test_the_call_grammar_gives_calls_that_validate(llm: LLM, parallel: bool) -> None:
    grammar = tool_call_grammar([WEATHER, TIME], parallel=parallel, param="tools")
    messages = messages_with_tools([{"role": "user", "content": "What's the weather in Rome and the time in CET?"}],
                                   [WEATHER, TIME])
    prompt = llm.chat_prompt(messages)
    outs = llm.generate([prompt] * 4, [SamplingParams(max_tokens=120, temperature=t, seed=i, grammar=grammar)
                                       for i, t in enumerate((0.0, 0.7, 1.0, 1.2))])
    schemas = {"get_weather": WEATHER.parameters, "get_time": TIME.parameters}
    for out in outs:
        assert out.finish_reason == "stop", out.text
        msg = read_message(out.text)
        assert msg.content is None and msg.tool_calls
        assert parallel or len(msg.tool_calls) == 1
        for c in msg.tool_calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_definitions_move_to_the_root_of_the_call_schema_renamed_per_function() -> None:
    from forge.text.tool_calls import _hoisted

    params = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                               "old": {"$ref": "#/definitions/Old"}},
              "$defs": {"Item": {"type": "object", "properties": {"sub": {"$ref": "#/$defs/Sub"}}},
                        "Sub": {"type": "string"}},
              "definitions": {"Old": {"type": "integer"}}}
    body, defs = _hoisted(params, "f1_")
    assert "$defs" not in body and "definitions" not in body
    assert body["properties"]["items"]["items"] == {"$ref": "#/$defs/f1_Item"}
    assert body["properties"]["old"] == {"$ref": "#/$defs/f1_Old"}
    assert set(defs) == {"f1_Item", "f1_Sub", "f1_Old"}
    assert defs["f1_Item"]["properties"]["sub"] == {"$ref": "#/$defs/f1_Sub"}
    assert _hoisted({"type": "object"}, "f0_") == ({"type": "object"}, {})
    # two functions defining the same name keep theirs apart, and the grammar compiles
    other = {**params, "$defs": {**params["$defs"], "Item": {"type": "integer"}}}
    assert tool_call_grammar([Function("a", None, params), Function("b", None, other)], parallel=True,
                             param="tools")


def test_strict_schemas_are_closed_where_they_do_not_say_otherwise() -> None:
    from forge.sampling.structured import strict_schema

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "number"}}},
        "b": {"type": "array", "items": {"properties": {"y": {"type": "string"}}}},
        "c": {"type": "object", "additionalProperties": True, "required": [], "properties": {"z": {}}},
        "d": {"anyOf": [{"type": "object", "properties": {"w": {}}}, {"type": "null"}]}}}
    out = strict_schema(schema)
    assert out["additionalProperties"] is False and out["required"] == ["a", "b", "c", "d"]
    assert out["properties"]["a"]["additionalProperties"] is False and out["properties"]["a"]["required"] == ["x"]
    assert out["properties"]["b"]["items"]["required"] == ["y"]
    assert out["properties"]["c"]["additionalProperties"] is True and out["properties"]["c"]["required"] == []
    assert out["properties"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert out["properties"]["d"]["anyOf"][1] == {"type": "null"}
    assert "additionalProperties" not in schema                              # a new schema
    assert strict_schema(True) is True


def test_numbers_a_schema_leaves_unbounded_get_bounds_that_end_their_digits() -> None:
    from forge.sampling.structured import NUMBER_LIMIT, NUMBER_STEP, bounded_numbers

    schema = {"type": "object", "properties": {
        "n": {"type": "number"}, "i": {"type": "integer"}, "own": {"type": "number", "minimum": 0, "multipleOf": 0.5},
        "either": {"type": ["number", "null"]}, "s": {"type": "string"},
        "list": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 10}}}}
    out = bounded_numbers(schema)["properties"]
    assert out["n"] == {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": NUMBER_STEP}
    assert out["i"] == {"type": "integer", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}
    assert out["own"] == {"type": "number", "minimum": 0, "multipleOf": 0.5, "maximum": NUMBER_LIMIT}
    assert out["either"]["multipleOf"] == NUMBER_STEP and out["s"] == {"type": "string"}
    assert out["list"]["items"] == {"type": "integer", "exclusiveMaximum": 10, "minimum": -NUMBER_LIMIT}
    assert "minimum" not in schema["properties"]["n"]                        # a new schema


def test_objects_that_list_their_keys_are_closed_unless_they_say_otherwise() -> None:
    from forge.sampling.structured import closed_objects

    item = {"properties": {"p": {"type": "string"}}}
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                               "open": {"properties": {"x": {}}, "additionalProperties": True},
                                               "free": {"type": "object"},
                                               "mixed": {"properties": {"a": {}}, "allOf": [item, item]}},
              "$defs": {"Item": item}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False and out["$defs"]["Item"]["additionalProperties"] is False
    props = out["properties"]
    assert props["open"]["additionalProperties"] is True                      # what a schema says stands
    assert props["free"] == {"type": "object"}                                # lists no keys: any object
    # Keys from an allOf: neither the object nor its parts are closed (they would exclude each other).
    assert "additionalProperties" not in props["mixed"]
    assert all("additionalProperties" not in part for part in props["mixed"]["allOf"])
    assert "additionalProperties" not in schema and "additionalProperties" not in item     # a new schema


def test_a_closed_object_refuses_keys_it_does_not_list(default_model_path: Path) -> None:
    """Through the grammar, on the real tokenizer: the listed key is accepted, another is not."""
    from forge.sampling.structured import Grammars, json_schema_grammar
    from forge.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path)
    grammars = Grammars(tok)
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}},
                                  param="schema")

    def accepts(text: str) -> bool:
        matcher = grammars.matcher(grammar)
        return all(matcher.consume_token(i) for i in tok.encode_exact(text)) and matcher.is_accepting()

    assert accepts('{"a": 3}') and accepts("{}")
    assert not accepts('{"a": 3, "b": 4}')
