"""The Responses API's wire format: its decoding (a 400 naming the field for anything wrong), the chat
request it means (the same preparation as chat's equivalent body), its response shapes (a stream that
accumulates to the body) and its store (bounded in count and in age)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from forge.api.openai.openai_prepare import prepare_chat
from forge.api.openai.openai_schema import ContentPart, NamedToolChoice
from forge.api.responses import responses_output as wire
from forge.api.responses.responses_schema import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    FunctionCallItem,
    Item,
    MessageItem,
    chat_messages,
    chat_request,
    decode_responses,
    input_items,
    max_calls,
    prepare_response,
    wire_param,
)
from forge.api.responses.responses_store import ResponseStore
from forge.api.responses.responses_tools import call_names, warning_header, warnings
from forge.api.sse import sse_event
from forge.errors import InvalidRequest
from forge.text.tool_reader import ArgumentsDelta, CallStart, ContentDelta, ToolCallReader

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}


def body(**fields: Any) -> bytes:
    raw = {"model": "m", "input": "Hi", **fields}
    return json.dumps({k: v for k, v in raw.items() if v is not None}).encode()


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
     "input[0].output[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"temperature": -1}, "temperature"),
    # not top_p 0: msgspec checks the exclusive bound against the smallest denormal, which reads as 0
    # once an earlier test in the process has turned on denormals-are-zero (after tests/unit/test_kernels.py)
    ({"top_p": 1.5}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tools": [{"name": "no_type"}]}, "tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{**WEATHER, "parameters": {"type": "array"}}]}]},
     "tools[0].tools[0].parameters"),
    ({"tools": [WEATHER, {"type": "namespace", "name": "ns", "tools": [WEATHER, WEATHER]}]}, "tools"),
    ({"tools": [{"type": "namespace", "name": "bad name", "tools": []}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}}, "tool_choice.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"thinking_budget": -1}, "thinking_budget"),
])
def test_a_bad_field_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        decode_responses(body(**fields))
    assert refused.value.param == param, refused.value.message


def test_unknown_fields_are_ignored_nulls_are_absent_and_a_message_may_leave_its_type_out() -> None:
    req = decode_responses(body(include=["reasoning.encrypted_content"], reasoning=None, truncation="auto",
                                service_tier="auto", top_p=None, input=[
                                    {"role": "user", "content": "Hi", "id": "x"},
                                    {"type": "reasoning", "id": "rs_1", "summary": []},
                                    {"type": "message", "role": "assistant", "status": "completed", "content": [
                                        {"type": "output_text", "text": "Hello", "annotations": []}]}]))
    assert req.top_p == 1.0 and req.store and not req.stream and req.tool_choice is None
    assert [type(i).__name__ for i in input_items(req)] == ["MessageItem", "ReasoningItem", "MessageItem"]
    user, assistant = chat_messages(input_items(req))                # the reasoning item is not shown
    assert (user.role, user.content) == ("user", "Hi")
    assert assistant.role == "assistant" and assistant.content == [ContentPart(type="text", text="Hello")]


def test_a_conversation_with_calls_is_the_chat_request_it_means() -> None:
    req = decode_responses(body(
        instructions="Be brief.", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False, temperature=0.5, top_p=0.9, seed=7, max_output_tokens=30, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo"},
                                         {"type": "input_text", "text": "and Rome?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
        ]))
    chat = chat_request(req, input_items(req))
    equivalent = json.dumps({
        "model": "m", "max_completion_tokens": 30, "temperature": 0.5, "top_p": 0.9, "seed": 7,
        "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo"},
                                         {"type": "text", "text": "and Rome?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking."}], "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]}).encode()
    ours = prepare_response(req, (), served_model_name="m", max_model_len=512)[1]
    theirs = prepare_chat(equivalent, served_model_name="m", max_model_len=512)
    assert ours.messages == theirs.messages and ours.functions == theirs.functions
    assert ours.params == theirs.params and ours.constraint == theirs.constraint
    assert isinstance(chat.tool_choice, NamedToolChoice) and max_calls(req) == 1


def test_a_call_with_no_text_before_it_is_an_assistant_turn_of_its_own() -> None:
    items: tuple[Item, ...] = (MessageItem(role="user", content="Hi"),
                               FunctionCallItem(call_id="c", name="f", arguments="{}"))
    [user, call] = chat_messages(items)
    assert call.role == "assistant" and call.content is None and call.tool_calls is not None
    assert call.tool_calls[0].id == "c" and user.content == "Hi"


def test_a_text_format_is_chat_s_response_format_and_closes_within_the_limit() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = decode_responses(body(max_output_tokens=40, text={"format": {
        "type": "json_schema", "name": "n", "schema": schema, "strict": True}}))
    ours = prepare_response(req, (), served_model_name="m", max_model_len=512)[1]
    theirs = prepare_chat(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 40,
                                      "response_format": {"type": "json_schema", "json_schema": {
                                          "name": "n", "schema": schema, "strict": True}}}).encode(),
                          served_model_name="m", max_model_len=512)
    assert ours.params == theirs.params and ours.params.close_within == 10 and ours.params.grammar
    plain = prepare_response(decode_responses(body()), (), served_model_name="m", max_model_len=512)[1]
    assert plain.constraint is None and plain.params.max_tokens == DEFAULT_MAX_OUTPUT_TOKENS   # not the context
    assert wire.echo(decode_responses(body()))["max_output_tokens"] == DEFAULT_MAX_OUTPUT_TOKENS


def test_a_stored_conversation_goes_before_the_input_and_instructions_before_both() -> None:
    history: tuple[Item, ...] = (MessageItem(role="user", content="One"), MessageItem(role="assistant", content="Two"))
    req = decode_responses(body(instructions="Sys", input="Three", previous_response_id="resp_1"))
    conversation, prep = prepare_response(req, history, served_model_name="m", max_model_len=512)
    assert conversation == (*history, MessageItem(role="user", content="Three"))
    assert [(m["role"], m["content"]) for m in prep.messages] == [
        ("system", "Sys"), ("user", "One"), ("assistant", "Two"), ("user", "Three")]


def test_errors_on_the_chat_request_name_the_field_as_sent() -> None:
    assert wire_param("response_format.json_schema.schema") == "text.format.schema"
    assert wire_param("messages") == "input" and wire_param("prompt") == "input"
    assert wire_param("max_completion_tokens") == "max_output_tokens"
    assert wire_param("reasoning_effort") == "reasoning.effort"
    assert wire_param("tools") == "tools" and wire_param(None) is None


def accumulate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a client accumulating the stream's item events holds (as the openai client's helper does)."""
    output: list[dict[str, Any]] = []
    for e in events:
        match e["type"]:
            case "response.output_item.added":
                assert e["output_index"] == len(output)
                output.append(e["item"])
            case "response.content_part.added":
                output[e["output_index"]]["content"].append(e["part"])
            case "response.output_text.delta" | "response.reasoning_text.delta":
                output[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
            case "response.function_call_arguments.delta":
                output[e["output_index"]]["arguments"] += e["delta"]
            case "response.output_item.done":
                output[e["output_index"]] = e["item"]
    return output


def test_streamed_items_accumulate_to_the_body_s_items() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = wire.OutputItems()
    whole.push(ToolCallReader().push(text))
    reader, pieces, events = ToolCallReader(), wire.OutputItems(), []
    for i in range(0, len(text), 3):
        events += pieces.push(reader.push(text[i:i + 3]))
    events += pieces.push(reader.finish()) + pieces.close("completed")
    ends = whole.close("completed")
    items = pieces.items()
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "Sure." and json.loads(items[1]["arguments"]) == {"city": "Oslo"}
    assert all(i["status"] == "completed" for i in items) and ends[-1]["type"] == "response.output_item.done"
    assert accumulate(events) == items
    strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]
    assert strip == [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in whole.items()]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["name"] == "get_weather" and done["arguments"] == items[1]["arguments"]


def test_an_empty_answer_is_one_empty_message_and_a_cut_one_is_incomplete() -> None:
    items = wire.OutputItems()
    events = items.close("incomplete")
    [message] = items.items()
    assert message["type"] == "message" and message["content"][0]["text"] == "" and message["status"] == "incomplete"
    assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done",
                                           "response.output_item.done"]
    assert wire.status("length") == wire.status(None) == "incomplete" and wire.status("stop") == "completed"
    body = wire.response(response_id="resp_1", created_at=1, model="m", status="incomplete", echoed={},
                         output=items.items(), usage=wire.usage(prompt_tokens=9, cached_tokens=0, output_tokens=2))
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["usage"]["total_tokens"] == 11
    events2 = wire.OutputItems().push([ContentDelta("a"), CallStart(0, "call_1", "f"), ArgumentsDelta(0, "{}")])
    assert [e["type"] for e in events2][-2:] == ["response.output_item.added", "response.function_call_arguments.delta"]


def test_a_thinking_section_is_a_reasoning_item_before_the_message() -> None:
    items, events = wire.OutputItems(), []
    for piece in ("Paris is", " the capital."):
        events += items.push_reasoning(piece)
    events += items.push_reasoning("")                 # a delta that added nothing to the section
    events += items.push([ContentDelta("Paris.")]) + items.close("completed")
    thought, said = items.items()
    assert thought["type"] == "reasoning" and thought["summary"] == [] and thought["status"] == "completed"
    assert thought["content"] == [{"type": "reasoning_text", "text": "Paris is the capital."}]
    assert said["type"] == "message" and said["content"][0]["text"] == "Paris."
    assert accumulate(events) == items.items()
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.output_item.added", "response.content_part.added",
                         "response.reasoning_text.delta", "response.reasoning_text.delta"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 3] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done"] and done < kinds.index("response.output_text.delta")
    assert next(e for e in events if e["type"] == "response.reasoning_text.done")["text"] == "Paris is the capital."
    # cut inside the section: only the reasoning item, incomplete (as chat's content is then null)
    cut = wire.OutputItems()
    cut.push_reasoning("Hmm")
    cut.close("incomplete")
    assert [(i["type"], i["status"]) for i in cut.items()] == [("reasoning", "incomplete")]
    counted = wire.usage(prompt_tokens=5, cached_tokens=0, output_tokens=9, reasoning_tokens=7)
    assert counted["output_tokens_details"] == {"reasoning_tokens": 7}


def test_every_frame_is_named_by_its_type() -> None:
    frame = sse_event({"type": "response.created", "sequence_number": 0})
    name, data = frame.decode().removesuffix("\n\n").split("\n")
    assert name == "event: response.created" and json.loads(data.removeprefix("data: "))["sequence_number"] == 0


def test_the_store_forgets_the_oldest_past_its_size_and_each_past_its_ttl() -> None:
    store = ResponseStore(max_responses=2, ttl_s=10.0)
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, (), now=float(i))
    assert store.get("r0", now=3.0) is None and store.get("r1", now=3.0) is not None
    assert store.get("r1", now=11.0) is None and store.get("r2", now=11.0) is not None
    assert store.get("r2", now=12.0) is None and store.statistics().num_stored == 0
    store.put("r3", {}, (), now=20.0)
    assert store.delete("r3", now=21.0) and not store.delete("r3", now=21.0)
    none = ResponseStore(max_responses=0)
    none.put("r", {}, (), now=0.0)
    assert none.get("r", now=0.0) is None
    with pytest.raises(ValueError):
        ResponseStore(max_responses=-1)
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)


# A request body as OpenAI's Codex CLI sends it (wire_api = "responses"): flat functions, a custom tool and
# hosted ones it lets the server run, an MCP server's tools in a namespace, developer instructions.
CODEX_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
     "strict": False, "parameters": {"type": "object", "additionalProperties": False, "required": ["command"],
                                     "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                    "workdir": {"type": "string"}}}},
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "local_shell"},
    {"type": "web_search", "external_web_access": False},
    {"type": "namespace", "name": "mcp__docs__", "description": "The project's documentation server.",
     "tools": [{"type": "function", "name": "search", "description": "Search the docs.", "strict": False,
                "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
               {"type": "custom", "name": "raw", "description": "x"}]},
    {"type": "image_generation"}, {"type": "mcp", "server_label": "x", "server_url": "https://example.com"},
]


def test_codex_s_tools_offer_its_functions_flat_and_decline_what_forge_does_not_run() -> None:
    req = decode_responses(body(tools=CODEX_TOOLS, tool_choice="auto", parallel_tool_calls=False, store=False,
                                stream=True, include=["reasoning.encrypted_content"], prompt_cache_key="t",
                                reasoning={"effort": "medium", "summary": "auto"}, text={"verbosity": "low"},
                                instructions="You are a coding agent."))
    chat = chat_request(req, input_items(req))
    assert [t.function.name for t in chat.tools or ()] == ["shell", "mcp__docs__search"]
    assert (chat.tools or [])[1].function.description == "The project's documentation server.\nSearch the docs."
    assert call_names(req.tools) == {"shell": (None, "shell"), "mcp__docs__search": ("mcp__docs__", "search"),
                                     "search": ("mcp__docs__", "search")}
    notes = warnings(req.tools)
    assert [(w["param"], w["code"]) for w in notes] == [
        ("tools[1]", "tool_not_served"), ("tools[2]", "tool_not_served"), ("tools[3]", "tool_not_served"),
        ("tools[4].tools[1]", "tool_not_served"), ("tools[5]", "tool_not_served"), ("tools[6]", "tool_not_served")]
    assert "'web_search'" in notes[2]["message"]
    header = warning_header(notes)
    assert header is not None and header.startswith('299 forge "tools[1]: ') and header.count('"') == 2
    echoed = wire.echo(req)
    assert echoed["warnings"] == notes and [t["type"] for t in echoed["tools"]] == ["function", "namespace"]
    assert echoed["tools"][1]["tools"] == [CODEX_TOOLS[4]["tools"][0]]
    assert echoed["max_output_tokens"] == DEFAULT_MAX_OUTPUT_TOKENS
    assert "warnings" not in wire.echo(decode_responses(body(tools=[WEATHER])))
    only_hosted = decode_responses(body(tools=[{"type": "web_search"}], tool_choice="auto"))
    assert chat_request(only_hosted, input_items(only_hosted)).tools is None    # offered nothing, refused nothing


def test_a_namespaced_call_is_named_back_with_its_namespace_and_replayed_under_its_flat_name() -> None:
    req = decode_responses(body(tools=CODEX_TOOLS))
    items = wire.OutputItems(call_names(req.tools))
    text = '<tool_call>\n{"name": "mcp__docs__search", "arguments": {"query": "turns"}}\n</tool_call>'
    events = items.push(ToolCallReader().push(text)) + items.close("completed")
    [call] = items.items()
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "search", "mcp__docs__")
    assert accumulate(events) == items.items()
    replayed = decode_responses(body(tools=CODEX_TOOLS, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Find turns."}]},
        {k: v for k, v in call.items() if k not in ("id", "status")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "found"}]))
    [_, assistant, tool] = chat_messages(input_items(replayed))
    assert assistant.tool_calls is not None and assistant.tool_calls[0].function.name == "mcp__docs__search"
    assert tool.role == "tool" and tool.tool_call_id == call["call_id"]
    plain = wire.OutputItems(call_names(req.tools))
    plain.push(ToolCallReader().push('<tool_call>\n{"name": "shell", "arguments": {"command": ["ls"]}}\n</tool_call>'))
    assert "namespace" not in plain.items()[0] and plain.items()[0]["name"] == "shell"
