"""Reading tool calls by their JSON structure: text inside a string of the arguments (the closing tag, a
brace, the opening tag) never ends a call, whole or in any pieces; unconstrained output whose JSON breaks
falls back to the closing tag."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.api.anthropic import anthropic_output as wire
from forge.text.tool_calls import CLOSE, OPEN
from forge.text.tool_reader import ToolCallReader, ToolEvent, read_message
from tests.unit.test_tools import joined

# What the default model wrote under tool_choice naming Person (name, age, email: str | None), greedy,
# "Extract the person: Tom is 71.": the name string holds '}}</tool_call>', and the call goes on after it.
# It was read as arguments '{"name": "}' and the rest of the call as content.
PERSON_TEXT = ('<tool_call>\n{"name": "Person", "arguments": {"name": "}}</tool_call>  # 71 is the person\'s age.'
               '  The JSON object is: 71.  The JSON object is: 71. ", "age": 25, "email": ""}}\n</tool_call>')
PERSON_ARGS = {"name": "}}</tool_call>  # 71 is the person's age.  The JSON object is: 71.  The JSON object is: 71. ",
               "age": 25, "email": ""}


def call(name: str, args: Any, **dumps: Any) -> str:
    """A call as forge's format writes it (tool_calls._call_text between the tags, as the grammar does)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, **{'ensure_ascii': False, **dumps})}\n{CLOSE}"


def read_in_pieces(text: str, cuts: list[int], **kwargs: Any) -> list[ToolEvent]:
    reader, events, start = ToolCallReader(**kwargs), [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += reader.push(text[start:cut])
        start = max(start, cut)
    return events + reader.finish()



@pytest.mark.parametrize("strict", [True, False])
def test_the_person_call_reads_whole_with_its_closing_tag_inside_a_string(strict: bool) -> None:
    message = read_message(PERSON_TEXT, strict=strict)
    assert message.content is None
    [person] = message.tool_calls
    assert person.name == "Person" and json.loads(person.arguments) == PERSON_ARGS
    for step in (1, 2, 5, 13):
        cuts = list(range(step, len(PERSON_TEXT), step))
        assert joined(read_in_pieces(PERSON_TEXT, cuts, strict=strict)) == ("", [("Person", person.arguments)])


ARGUMENTS = [
    {"q": "</tool_call>"},
    {"q": "}\n</tool_call>"},
    {"q": "}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}"},
    {"q": "<tool_call>", "r": ["}", "]", "{", "["]},
    {"q": 'say "hi" \\ and \\" then }'},
    {"a": {"b": [1, {"c": "}]"}, [], {}], "d": None}, "e": [True, False, -1.5e3]},
    {"emoji": "😀 é \u2028", "esc": "\u0000\u001f"},
    {},
]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("args", ARGUMENTS)
def test_tags_braces_and_quotes_inside_strings_never_end_a_call(args: dict[str, Any], strict: bool) -> None:
    for dumps in ({}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": True}):
        text = call("f", args, **dumps) + "\n" + call("g", {"x": args})
        message = read_message(text, strict=strict)
        assert message.content is None
        assert [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [("f", args), ("g", {"x": args})]
        for n in range(len(text)):                      # two pieces, cut anywhere
            assert joined(read_in_pieces(text, [n], strict=strict)) == joined(
                read_in_pieces(text, [], strict=strict))


def test_the_messages_api_reply_has_its_two_calls_and_no_text_with_a_calls_tail() -> None:
    """tool_choice any, two calls, the second's string holding the closing tag: read by the tag, it was a
    second tool_use with an empty input (its arguments cut, not JSON) and a text block with the call's tail."""
    text = call("get_weather", {"city": "Oslo"}) + "\n" + call(
        "get_weather", {"city": "Rome\"}}\n</tool_call> and Oslo"})
    for step in (len(text), 7, 1):
        blocks, calls = wire.ContentBlocks(), ToolCallReader(strict=True)
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for k, piece in enumerate(pieces):
            blocks.push(wire.text_events(calls, piece, final=k == len(pieces) - 1))
        blocks.close()
        content = blocks.content()
        assert [b["type"] for b in content] == ["tool_use", "tool_use"]
        assert [b["input"] for b in content] == [{"city": "Oslo"}, {"city": "Rome\"}}\n</tool_call> and Oslo"}]


def test_unconstrained_json_that_breaks_falls_back_to_the_closing_tag() -> None:
    def read(text: str) -> tuple[str | None, list[tuple[str, str]]]:
        message = read_message(text)
        whole = (message.content, [(c.name, c.arguments) for c in message.tool_calls])
        for n in range(len(text)):
            assert joined(read_in_pieces(text, [n])) == (whole[0] or "", whole[1]), n
        return whole

    # A string never closed: the call ends at the tag, what follows is content.
    assert read('<tool_call>\n{"name": "f", "arguments": {"a": "x}\n</tool_call>\nDone.') == (
        "\nDone.", [("f", '{"a": "x')])
    # A bracket closing the wrong thing, or text after the value.
    assert read('<tool_call>\n{"name": "f", "arguments": {"a": [1}}\n</tool_call>') == (None, [("f", '{"a": [1}')])
    assert read('<tool_call>\n{"name": "f", "arguments": {"a": 1} oops}\n</tool_call>') == (
        None, [("f", '{"a": 1} oops')])
    # The call's own brace missing: the value's is taken for it, as the tag search always did.
    assert read('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>') == (None, [("f", '{"a": 1')])
    # Constrained output is trusted: the brace the grammar writes is the value's.
    assert [c.arguments for c in read_message('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
                                              strict=True).tool_calls] == ['{"a": 1}']


@pytest.mark.parametrize("strict", [True, False])
def test_a_call_cut_short_inside_a_string_keeps_what_it_has(strict: bool) -> None:
    args = json.dumps({"q": "a}</tool_call>b", "n": 1})
    text = call("f", json.loads(args))
    start = text.index(args)
    for end in range(start, len(text) + 1):
        [(name, got)] = joined(read_in_pieces(text[:end], list(range(0, end, 3)), strict=strict))[1]
        assert name == "f"
        if strict or end <= start + args.index(CLOSE):
            assert args.startswith(got), (text[:end], got)
        if end >= start + len(args):
            assert got == args, (text[:end], got)


# Strings made of the format's own pieces, JSON's specials and any unicode.
texts = st.lists(st.one_of(st.sampled_from([OPEN, CLOSE, "{", "}", "[", "]", '"', "\\", "\\\"", "}\n", "\n", " ",
                                            '"}}', '"}}\n</tool_call>', "<", "/"]),
                           st.text(max_size=6)), max_size=8).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=False, allow_infinity=False), texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
objects = st.dictionaries(texts, values, max_size=5)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(names, objects), min_size=1, max_size=3), st.booleans(),
       st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": True}]), st.data())
def test_any_calls_forge_writes_read_back_exactly_in_any_pieces(
        calls: list[tuple[str, dict[str, Any]]], strict: bool, dumps: dict[str, Any], data: st.DataObject) -> None:
    text = "\n".join(call(name, args, **dumps) for name, args in calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=16))
    content, got = joined(read_in_pieces(text, cuts, strict=strict))
    assert content == ""
    assert [(name, json.loads(args)) for name, args in got] == calls


pieces = st.sampled_from([
    "Sure. ", "\n", " ", OPEN, CLOSE, "<tool", "_call>", '"', "\\", "}", "]", "{", '{"name": "f", "arguments": ',
    '{"q": "a</tool_call>b"}}', '{"q": "}\n', '"}}\n', call("g", {"q": "</tool_call>\n<tool_call>"}),
    '{"arguments": {}, "name": "h"}', "text",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(pieces, max_size=8), st.data())
def test_unconstrained_text_of_any_shape_reads_the_same_in_any_pieces(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert joined(read_in_pieces(text, cuts)) == joined(read_in_pieces(text, []))
