"""The wire schema of forge's Responses API (POST /v1/responses): the request Struct, its input items,
their decoder, and the one converter to the chat request the same pipeline runs. A response is another
wire format over a chat request, as a message is (forge/api/anthropic/anthropic_schema.py): its sampling, chat template,
tools and constraints are chat's (forge/api/openai/openai_prepare.py), so a response and the equivalent chat completion
give the same output. A stored conversation (previous_response_id) is a tuple of the same input items,
so a continued response renders exactly the prompt its client would have sent whole. Pure: no I/O.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from forge.api.openai.openai_prepare import PreparedChat, prepare_chat_request
from forge.api.openai.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    JsonSchemaFormat,
    MaxTokens,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    SamplingExtras,
    Temperature,
    ThinkingBudget,
    Tool,
    ToolCallFunction,
    TopP,
    sampling_extras,
)
from forge.api.responses.responses_tools import Tool as ResponsesTool
from forge.api.responses.responses_tools import call_names, check_tools, flat_name, normalise_tools, offered
from forge.api.wire_decode import decode_body
from forge.errors import InvalidRequest
from forge.sampling.reasoning import Effort

# The most tokens a response writes when its request sets no max_output_tokens: a bound on an answer that
# never ends (a small model repeating itself), not the whole context, which on a CPU is minutes of decoding.
DEFAULT_MAX_OUTPUT_TOKENS = 4096


class _ResponsesWire(msgspec.Struct, frozen=True, kw_only=True):
    """A request body's part. Unknown fields are ignored (id, status, annotations, ...)."""


# ---- content parts and input items ----------------------------------------------------------------------

class _Part(_ResponsesWire, frozen=True, kw_only=True, tag_field="type"):
    """A message's content part, told apart by its "type"."""


class InputText(_Part, frozen=True, kw_only=True, tag="input_text"):
    text: str


class OutputText(_Part, frozen=True, kw_only=True, tag="output_text"):
    """An earlier answer's text, as a client replays it (its annotations are ignored)."""
    text: str


class InputImage(_Part, frozen=True, kw_only=True, tag="input_image"):
    """Read only to be refused with a clear message: the models forge serves read text."""


class InputFile(_Part, frozen=True, kw_only=True, tag="input_file"):
    pass


Part = InputText | OutputText | InputImage | InputFile


class _Item(_ResponsesWire, frozen=True, kw_only=True, tag_field="type"):
    """An input item, told apart by its "type" (a message may leave it out: normalise_input)."""


class MessageItem(_Item, frozen=True, kw_only=True, tag="message"):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


class FunctionCallItem(_Item, frozen=True, kw_only=True, tag="function_call"):
    """An earlier call of the model's, as its output item had it (a namespaced function's with its namespace)."""
    call_id: str
    name: str
    arguments: str                                           # JSON text
    namespace: str | None = None


class FunctionCallOutputItem(_Item, frozen=True, kw_only=True, tag="function_call_output"):
    """The client's answer to a call."""
    call_id: str
    output: str | list[Part]


class ReasoningItem(_Item, frozen=True, kw_only=True, tag="reasoning"):
    """An earlier reasoning item, as clients replay output items: accepted, and not shown to the model."""


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# ---- tool choice, the text format (the tools: forge/api/responses/responses_tools.py) -------------------

class ToolChoiceFunction(_ResponsesWire, frozen=True, kw_only=True, tag_field="type", tag="function"):
    name: str


class _Format(_ResponsesWire, frozen=True, kw_only=True, tag_field="type"):
    pass


class FormatText(_Format, frozen=True, kw_only=True, tag="text"):
    pass


class FormatJsonObject(_Format, frozen=True, kw_only=True, tag="json_object"):
    pass


class FormatJsonSchema(_Format, frozen=True, kw_only=True, tag="json_schema"):
    name: str
    schema: dict[str, Any] | bool
    description: str | None = None
    strict: bool | None = None


TextFormat = FormatText | FormatJsonObject | FormatJsonSchema


class TextConfig(_ResponsesWire, frozen=True, kw_only=True):
    format: TextFormat = FormatText()


class ReasoningConfig(_ResponsesWire, frozen=True, kw_only=True):
    """How much a reasoning model may think: effort as chat's reasoning_effort (a budget of thinking
    tokens). The reasoning is returned whole as a reasoning item's text: summaries are not written."""
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# ---- the request ----------------------------------------------------------------------------------------

class ResponsesRequest(_ResponsesWire, SamplingExtras, frozen=True, kw_only=True):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    text: TextConfig = TextConfig()
    reasoning: ReasoningConfig | None = None
    tools: list[ResponsesTool] | None = None                # functions, namespaces; others declined, not run
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    metadata: dict[str, str] | None = None                  # echoed back
    user: str | None = None
    background: bool = False                                 # only false is served
    conversation: str | dict[str, Any] | None = None          # not served: refused if given
    # forge's sampling extras are inherited as chat's are (SamplingExtras); these two are chat's own
    thinking_budget: ThinkingBudget | None = None                              # chat's: wins over the effort
    chat_template_kwargs: dict[str, Any] | None = None                        # chat's: the template's variables


Conversation = tuple[Item, ...]


# ---- decoding -------------------------------------------------------------------------------------------

def normalise_input(raw: Any) -> Any:
    """An input item with a role and no "type" is a message (the API's "easy input message"); a tool of a
    type forge does not run is kept apart (responses_tools.normalise_tools), not refused."""
    if isinstance(raw, dict) and isinstance(raw.get("input"), list):
        items = [{**item, "type": "message"} if isinstance(item, dict) and "type" not in item and "role" in item
                 else item for item in raw["input"]]
        raw = {**raw, "input": items}
    if isinstance(raw, dict) and "tools" in raw:
        raw = {**raw, "tools": normalise_tools(raw["tools"])}
    return raw


def decode_responses(body: bytes) -> ResponsesRequest:
    """A body -> its request, or InvalidRequest whose param is the bad field's path ("input[0].role")."""
    req = decode_body(body, ResponsesRequest, normalise=normalise_input)
    _check(req)
    return req


def _check(req: ResponsesRequest) -> None:
    if req.background:
        raise InvalidRequest("background responses are not supported: a response runs while its request waits",
                             param="background")
    if req.conversation is not None:
        raise InvalidRequest("conversations are not supported: continue a response with previous_response_id",
                             param="conversation")
    if req.input == [] and req.previous_response_id is None and req.instructions is None:
        raise InvalidRequest("input must not be empty", param="input")
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        content = item.content if isinstance(item, MessageItem) else (
            item.output if isinstance(item, FunctionCallOutputItem) else "")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, InputImage | InputFile):
                kind = "images" if isinstance(part, InputImage) else "files"
                field = "content" if isinstance(item, MessageItem) else "output"
                raise InvalidRequest(f"input {kind} are not supported: the model served reads text only",
                                     param=f"input[{i}].{field}[{j}]")
    _check_tools(req)


def _check_tools(req: ResponsesRequest) -> None:
    check_tools(req.tools)
    names = call_names(req.tools)
    choice = req.tool_choice
    if (choice == "required" or isinstance(choice, ToolChoiceFunction)) and not names:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceFunction) and choice.name not in names:
        raise InvalidRequest(f"tool_choice names the function {choice.name!r}, which is not in tools",
                             param="tool_choice.name")
    forced = choice == "required" or isinstance(choice, ToolChoiceFunction)
    if forced and not isinstance(req.text.format, FormatText):
        raise InvalidRequest("only one output constraint may be given: a forced tool call or text.format",
                             param="text.format")


# ---- the chat request it is ------------------------------------------------------------------------------

def input_items(req: ResponsesRequest) -> Conversation:
    """The request's input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return (MessageItem(role="user", content=req.input),)
    return tuple(req.input)


def chat_messages(items: Conversation) -> list[ChatMessage]:
    """Items as the chat messages they mean: a message as itself; function calls as the tool_calls of
    the assistant message just before them (or of a new one: an answer that was only calls); each
    call's output as a tool message; reasoning items dropped (the template never showed them)."""
    out: list[ChatMessage] = []
    for item in items:
        match item:
            case MessageItem(role=role, content=content):
                out.append(ChatMessage(role=role, content=_parts(content)))
            case FunctionCallItem(call_id=call_id, name=name, arguments=arguments, namespace=namespace):
                called = name if namespace is None or name.startswith(flat_name(namespace, "")) else (
                    flat_name(namespace, name))          # the name the model was offered it under
                call = MessageToolCall(id=call_id, function=ToolCallFunction(name=called, arguments=arguments))
                last = out[-1] if out else None
                if last is not None and last.role == "assistant":
                    out[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or ()), call])
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            case FunctionCallOutputItem(call_id=call_id, output=output):
                out.append(ChatMessage(role="tool", content=_text(output), tool_call_id=call_id))
    return out


def _parts(content: str | list[Part]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [ContentPart(type="text", text=p.text) for p in content if isinstance(p, InputText | OutputText)]


def _text(output: str | list[Part]) -> str:
    if isinstance(output, str):
        return output
    return "\n".join(p.text for p in output if isinstance(p, InputText | OutputText))


def chat_request(req: ResponsesRequest, conversation: Conversation) -> ChatCompletionRequest:
    """The chat request a response means: instructions as a first system message, then the stored
    conversation and this input (`conversation`, chat_messages); the functions offered (flat, and each
    namespace's under its flat name) as chat's tools; text.format as response_format; max_output_tokens
    (or DEFAULT_MAX_OUTPUT_TOKENS) as max_completion_tokens; reasoning.effort as reasoning_effort; the
    sampling extras as they are."""
    messages = chat_messages(conversation)
    if req.instructions is not None:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    tools = [Tool(type="function", function=FunctionDefinition(
        name=flat_name(namespace, f.name), description=_described(f.description, about),
        parameters=f.parameters, strict=f.strict)) for namespace, f, about in offered(req.tools)] or None
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        namespace, name = call_names(req.tools)[choice.name]
        tool_choice: Any = NamedToolChoice(type="function", function=NamedFunction(name=flat_name(namespace, name)))
    else:
        tool_choice = choice if tools is not None or choice == "none" else None   # every tool declined: none
    return ChatCompletionRequest(
        **sampling_extras(req), model=req.model, messages=messages, max_completion_tokens=output_bound(req),
        temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        response_format=_response_format(req.text.format), tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        thinking_budget=req.thinking_budget, chat_template_kwargs=req.chat_template_kwargs)


def output_bound(req: ResponsesRequest) -> int:
    """The most tokens the response writes: max_output_tokens, else DEFAULT_MAX_OUTPUT_TOKENS (or min_tokens,
    if more). The context's end bounds it too."""
    if req.max_output_tokens is not None:
        return req.max_output_tokens
    return max(DEFAULT_MAX_OUTPUT_TOKENS, req.min_tokens)


def _described(description: str | None, namespace_description: str | None) -> str | None:
    """A namespaced function's description, after its namespace's (what the model reads of the group)."""
    if namespace_description is None:
        return description
    return namespace_description if description is None else f"{namespace_description}\n{description}"


def _response_format(fmt: TextFormat) -> ResponseFormat | None:
    match fmt:
        case FormatJsonObject():
            return ResponseFormat(type="json_object")
        case FormatJsonSchema(name=name, schema=schema, description=description, strict=strict):
            return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
                name=name, description=description, schema=schema, strict=strict))
    return None


def max_calls(req: ResponsesRequest) -> int | None:
    """The most calls read out of one answer: one without parallel calls, else max_tool_calls (or any)."""
    return 1 if not req.parallel_tool_calls else req.max_tool_calls


def prepare_response(req: ResponsesRequest, history: Conversation, *, served_model_name: str,
                     max_model_len: int) -> tuple[Conversation, PreparedChat]:
    """The conversation this response continues with (`history`, the stored one, then this input) and
    what the engine runs for it (chat's preparation). The JSON schema's errors name text.format."""
    conversation = history + input_items(req)
    prep = prepare_chat_request(chat_request(req, conversation), served_model_name=served_model_name,
                                max_model_len=max_model_len)
    return conversation, prep


# chat's field -> the Responses API's, for errors raised on the chat request a response became
_CHAT_FIELDS = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("messages", "input"), ("prompt", "input"),
                ("reasoning_effort", "reasoning.effort"))


def wire_param(param: str | None) -> str | None:
    """The Responses API's name of a field an error on the chat request names ("messages" -> "input")."""
    for chat, own in _CHAT_FIELDS:
        if param is not None and (param == chat or param.startswith(chat + ".")):
            return own + param[len(chat):]
    return param
