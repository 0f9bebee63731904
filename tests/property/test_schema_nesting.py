"""Schemas, tool parameters and grammars nested 1 to 2,000 levels deep (anyOf, properties, items, allOf, $ref
chains; chains of rules), through every API's preparation and the grammar check against the real vocabulary:
each is served (prepared, compiled, its tools rendered by the chat template) or a 400 naming the limit, never
anything else (a RecursionError was a 500; a deep $ref or rule chain overflowed llguidance's stack, SIGSEGV).
"""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from forge.api.anthropic.anthropic_schema import prepare_messages
from forge.api.openai.openai_prepare import (
    PreparedChat,
    PreparedCompletion,
    prepare_chat,
    prepare_completion,
    template_messages,
)
from forge.api.responses.responses_schema import decode_responses, prepare_response
from forge.errors import RequestError
from forge.llm import LoadedModel
from forge.sampling.nesting import MAX_GRAMMAR_DEPTH, MAX_SCHEMA_DEPTH, schema_depth
from forge.sampling.structured import Grammars, lark_grammar, regex_grammar

KINDS = ("anyOf", "properties", "items", "allOf", "$ref")
ROUTES = ("chat response_format", "chat response_format strict", "chat tools required", "chat tools auto",
          "completions guided_json", "completions structured_outputs", "responses text.format", "responses tools",
          "messages tools")


def nested(kind: str, levels: int) -> str:
    """An object schema with `levels` levels of `kind` around a string, as JSON text (json.dumps would recurse
    past Python's limit)."""
    if kind == "$ref":                     # a chain: d0 -> d1 -> ... -> a string
        defs = [f'"d{i}": {{"$ref": "#/$defs/d{i + 1}"}}' for i in range(levels)] + [f'"d{levels}": {STRING}']
        return f'{{"type": "object", "properties": {{"a": {{"$ref": "#/$defs/d0"}}}}, "$defs": {{{", ".join(defs)}}}}}'
    head, tail = {"anyOf": ('{"anyOf": [', "]}"), "allOf": ('{"allOf": [', "]}"),
                  "items": ('{"type": "array", "items": ', "}"),
                  "properties": ('{"type": "object", "properties": {"a": ', "}}")}[kind]
    return '{"type": "object", "properties": {"a": ' + head * levels + STRING + tail * levels + "}}"


STRING = '{"type": "string"}'


def expected_depth(kind: str, levels: int) -> int:
    """The schema's nesting as forge counts it, worked out by hand (not by the code under test)."""
    around = 3                             # the outer object, its properties, "a"'s schema
    if kind == "$ref":                     # "a" -> d0 -> ... -> d<levels>: one more than the levels
        return around + levels + 1
    return around + (levels if kind == "items" else 2 * levels)


def body(route: str, schema: str) -> bytes:
    """The route's request body with `schema` (JSON text) where that route takes one."""
    tool = f'{{"type": "function", "function": {{"name": "f", "parameters": {schema}}}}}'
    chat = '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4'
    match route:
        case "chat response_format" | "chat response_format strict":
            strict = json.dumps(route.endswith("strict"))
            fmt = f'{{"name": "x", "schema": {schema}, "strict": {strict}}}'
            text = f'{{{chat}, "response_format": {{"type": "json_schema", "json_schema": {fmt}}}}}'
        case "chat tools required" | "chat tools auto":
            text = f'{{{chat}, "tools": [{tool}], "tool_choice": "{route.rsplit(" ", 1)[1]}"}}'
        case "completions guided_json":
            text = f'{{"prompt": "hi", "max_tokens": 4, "guided_json": {json.dumps(schema)}}}'
        case "completions structured_outputs":
            text = f'{{"prompt": "hi", "max_tokens": 4, "structured_outputs": {{"json": {schema}}}}}'
        case "responses text.format":
            fmt = f'{{"type": "json_schema", "name": "x", "schema": {schema}}}'
            text = f'{{"input": "hi", "text": {{"format": {fmt}}}}}'
        case "responses tools":
            text = (f'{{"input": "hi", "tools": [{{"type": "function", "name": "f", "parameters": {schema}}}], '
                    '"tool_choice": "required"}')
        case "messages tools":
            text = (f'{{"model": "m", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}], '
                    f'"tools": [{{"name": "f", "input_schema": {schema}}}], "tool_choice": {{"type": "any"}}}}')
        case _:
            raise AssertionError(route)
    return text.encode()


def serve(route: str, raw: bytes, real: LoadedModel, grammars: Grammars) -> None:
    """What the gateway does with the body before submitting it: prepare, check the constraint against the
    vocabulary, render the chat template."""
    prep: PreparedChat | PreparedCompletion
    if route.startswith("chat"):
        prep = prepare_chat(raw, served_model_name="m", max_model_len=2048)
    elif route.startswith("completions"):
        prep = prepare_completion(raw, served_model_name="m")
    elif route.startswith("responses"):
        prep = prepare_response(decode_responses(raw), (), served_model_name="m", max_model_len=2048)[1]
    else:
        prep = prepare_messages(raw, served_model_name="m", max_model_len=2048)[1]
    if prep.constraint is not None:
        grammars.check(prep.constraint.grammar, param=prep.constraint.param)
    if isinstance(prep, PreparedChat):
        messages, tools = template_messages(real.chat_template.supports_tools, prep.messages, prep.functions)
        real.chat_template.render(messages, tools=tools)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(KINDS), route=st.sampled_from(ROUTES), levels=st.integers(1, 2000))
@example(kind="anyOf", route="chat response_format", levels=240)      # the 480 levels: a 500
@example(kind="properties", route="chat tools auto", levels=480)
@example(kind="items", route="messages tools", levels=MAX_SCHEMA_DEPTH - 3)
@example(kind="items", route="chat tools required", levels=MAX_SCHEMA_DEPTH - 2)
@example(kind="anyOf", route="responses text.format", levels=(MAX_SCHEMA_DEPTH - 3) // 2)
def test_a_nested_schema_is_served_or_refused_naming_the_limit(kind: str, route: str, levels: int,
                                                                real: LoadedModel, grammars: Grammars) -> None:
    schema = nested(kind, levels)
    depth = expected_depth(kind, levels)
    if depth < 500:
        assert schema_depth(json.loads(schema)) == depth
    try:
        serve(route, body(route, schema), real, grammars)
    except RequestError as exc:
        assert exc.status == 400, exc
        assert depth > MAX_SCHEMA_DEPTH, f"refused at depth {depth}: {exc}"
        # past what the body's own parser takes (Python's recursion limit) it is refused before the schema is read
        assert f"more than {MAX_SCHEMA_DEPTH} levels" in str(exc) or "nested too deeply" in str(exc), exc
    else:
        assert depth <= MAX_SCHEMA_DEPTH, f"served at depth {depth}"


def rule_chain(num_rules: int, parens: int, gbnf: bool) -> str:
    """A chain of rules, each wrapping the next in `parens` brackets."""
    define = " ::= " if gbnf else ": "
    first = "root" if gbnf else "start"
    rules = [f"{first}{define}r0"]
    rules += [f"r{i}{define}" + "(" * parens + f"r{i + 1}" + ")" * parens for i in range(num_rules)]
    return "\n".join([*rules, f'r{num_rules}{define}"a"']) + "\n"


@settings(max_examples=30, deadline=None)
@given(num_rules=st.integers(1, 5000), parens=st.integers(0, 25), gbnf=st.booleans())
@example(num_rules=5000, parens=0, gbnf=False)        # a 63 KB grammar that overflowed llguidance's stack
@example(num_rules=200, parens=25, gbnf=False)        # 12 KB, the same
@example(num_rules=MAX_GRAMMAR_DEPTH - 2, parens=0, gbnf=False)
def test_a_chain_of_rules_is_compiled_or_refused_naming_the_limit(num_rules: int, parens: int, gbnf: bool,
                                                                   grammars: Grammars) -> None:
    text = rule_chain(num_rules, parens, gbnf)
    try:
        grammars.check(lark_grammar(text, param="guided_grammar"))
    except RequestError as exc:
        assert exc.status == 400 and exc.param == "guided_grammar", exc
        if f"more than {MAX_GRAMMAR_DEPTH} levels" in str(exc):
            assert (num_rules + 1) * (parens + 1) + 2 > MAX_GRAMMAR_DEPTH
        else:          # the bound on size, llguidance's on brackets, the GBNF converter's recursion
            assert any(limit in str(exc) for limit in ("too large", "too deeply nested", "recursion")), exc


@settings(max_examples=30, deadline=None)
@given(levels=st.integers(1, 2000))
def test_a_nested_regex_is_compiled_or_refused(levels: int, grammars: Grammars) -> None:
    try:
        grammars.check(regex_grammar("(a|" * levels + "b" + ")" * levels, param="guided_regex"))
    except RequestError as exc:
        assert exc.status == 400, exc


def test_a_ref_chain_that_overflowed_llguidance_is_refused_before_it_is_compiled(grammars: Grammars) -> None:
    """3,000 $refs in a 106 KB schema (under the 128 KiB bound on a constraint's size) crashed the process."""
    raw = body("chat response_format", nested("$ref", 3000))
    with pytest.raises(RequestError, match=f"more than {MAX_SCHEMA_DEPTH} levels") as caught:
        prepare_chat(raw, served_model_name="m", max_model_len=2048)
    assert caught.value.param == "response_format.json_schema.schema"
    raw = body("chat tools auto", nested("$ref", 3000))
    with pytest.raises(RequestError, match=f"more than {MAX_SCHEMA_DEPTH} levels") as caught:
        prepare_chat(raw, served_model_name="m", max_model_len=2048)
    assert caught.value.param == "tools[0].function.parameters"
    grammar = "start: %json " + nested("$ref", 3000)
    with pytest.raises(RequestError, match=f"more than {MAX_GRAMMAR_DEPTH} levels"):
        lark_grammar(grammar, param="guided_grammar")


def test_deep_tool_call_arguments_in_the_history_are_kept_as_text() -> None:
    """An earlier call's arguments past Python's recursion limit are its text, not a 500."""
    args = "[" * 5000 + "]" * 5000
    raw = json.dumps({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}], "max_tokens": 2}).encode()
    prep = prepare_chat(raw, served_model_name="m", max_model_len=2048)
    assert prep.messages[1]["tool_calls"][0]["function"]["arguments"] == args
