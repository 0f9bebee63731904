"""The wire schema of forge's Anthropic-compatible Messages API (POST /v1/messages and
/v1/messages/count_tokens): request Structs, their decoders, and the one converter to the chat request
the same pipeline runs. A Messages request is another wire format over a chat request: its sampling,
chat template, tools and constraints are chat's (forge/api/openai/openai_prepare.py), so the two give the same output.
Unknown fields are ignored and a null field counts as absent, as on every forge route. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import json
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
    Tool,
    ToolCallFunction,
    TopP,
)
from forge.api.wire_decode import decode_body
from forge.errors import InvalidRequest
from forge.sampling.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

_MAX_INT32 = 2**31 - 1
Temperature = Annotated[float, Meta(ge=0.0, le=1.0)]       # the Messages API's range (chat's is 0-2)
TopK = Annotated[int, Meta(ge=0, le=_MAX_INT32)]           # 0: no top-k
StopSequences = Annotated[list[Annotated[str, Meta(max_length=MAX_STOP_LENGTH)]], Meta(max_length=MAX_STOP_STRINGS)]
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]   # as chat's function names


class _AnthropicWire(msgspec.Struct, frozen=True, kw_only=True):
    """A request body's part. Unknown fields are ignored (cache_control, citations, ...)."""


class _Block(_AnthropicWire, frozen=True, kw_only=True, tag_field="type"):
    """A content block, told apart by its "type"."""


class TextBlock(_Block, frozen=True, kw_only=True, tag="text"):
    text: str


class ImageBlock(_Block, frozen=True, kw_only=True, tag="image"):
    """Read only to be refused with a clear message: the models forge serves read text."""
    source: dict[str, Any] | None = None


class DocumentBlock(_Block, frozen=True, kw_only=True, tag="document"):
    source: dict[str, Any] | None = None


class ToolUseBlock(_Block, frozen=True, kw_only=True, tag="tool_use"):
    """An earlier call of the assistant's."""
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, frozen=True, kw_only=True, tag="tool_result"):
    """The user's answer to a call."""
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(_Block, frozen=True, kw_only=True, tag="thinking"):
    """An earlier turn's reasoning, sent back by clients; the prompt does not repeat it (as reasoning
    models' templates drop a past turn's section)."""
    thinking: str = ""
    signature: str = ""


Block = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(_AnthropicWire, frozen=True, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class MessagesTool(_AnthropicWire, frozen=True, kw_only=True):
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None


class _Choice(_AnthropicWire, frozen=True, kw_only=True, tag_field="type"):
    pass


class ToolChoiceAuto(_Choice, frozen=True, kw_only=True, tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Choice, frozen=True, kw_only=True, tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Choice, frozen=True, kw_only=True, tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Choice, frozen=True, kw_only=True, tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class CountTokensRequest(_AnthropicWire, frozen=True, kw_only=True):
    """POST /v1/messages/count_tokens: the prompt part of a Messages request."""

    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[MessagesTool] | None = None
    tool_choice: ToolChoice | None = None


class _Thinking(_AnthropicWire, frozen=True, kw_only=True, tag_field="type"):
    pass


class ThinkingEnabled(_Thinking, frozen=True, kw_only=True, tag="enabled"):
    budget_tokens: Annotated[int, Meta(ge=0, le=_MAX_INT32)] | None = None     # None: no bound


class ThinkingDisabled(_Thinking, frozen=True, kw_only=True, tag="disabled"):
    pass


class JsonOutputFormat(_AnthropicWire, frozen=True, kw_only=True):
    """Structured outputs: the answer's text is a JSON document valid under `schema` (chat's response_format
    json_schema: constrained decoding, the schema as given)."""
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_AnthropicWire, frozen=True, kw_only=True):
    format: JsonOutputFormat | None = None                     # `effort` and the rest are ignored


class MessagesRequest(CountTokensRequest, frozen=True, kw_only=True):
    """POST /v1/messages."""

    thinking: ThinkingEnabled | ThinkingDisabled | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None              # the structured-outputs beta's output_config.format

    max_tokens: MaxTokens
    stop_sequences: StopSequences | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    stream: bool = False
    metadata: dict[str, Any] | None = None                     # accepted and ignored


# ---- decoding -------------------------------------------------------------------------------------------

def decode_messages(body: bytes) -> MessagesRequest:
    """A body -> its request, or InvalidRequest whose param is the bad field's path ("messages[0].role")."""
    req = decode_body(body, MessagesRequest)
    _check(req)
    if req.output_format is not None and _format_param(req) == "output_config.format":
        raise InvalidRequest("give output_config.format or output_format, not both", param="output_format")
    if _format_param(req) is not None and isinstance(req.tool_choice, ToolChoiceAny | ToolChoiceTool):
        raise InvalidRequest("a tool_choice that forces a tool call and an output format cannot both shape "
                             "the answer", param="tool_choice")
    return req


def _format_param(req: MessagesRequest) -> str | None:
    """Where the request's output format is given, if it is."""
    if req.output_config is not None and req.output_config.format is not None:
        return "output_config.format"
    return "output_format" if req.output_format is not None else None


def decode_count_tokens(body: bytes) -> CountTokensRequest:
    req = decode_body(body, CountTokensRequest)
    _check(req)
    return req


def _check(req: CountTokensRequest) -> None:
    for i, msg in enumerate(req.messages):
        for j, block in enumerate(msg.content if isinstance(msg.content, list) else ()):
            at = f"messages[{i}].content[{j}]"
            _check_readable(block, at)
            if isinstance(block, ToolUseBlock) and msg.role != "assistant":
                raise InvalidRequest("tool_use blocks belong in assistant messages", param=at)
            if isinstance(block, ToolResultBlock):
                if msg.role != "user":
                    raise InvalidRequest("tool_result blocks belong in user messages", param=at)
                for k, part in enumerate(block.content if isinstance(block.content, list) else ()):
                    _check_readable(part, f"{at}.content[{k}]")
    if req.messages[-1].role == "assistant":
        raise InvalidRequest("the last message must be the user's: continuing a final assistant message "
                             "(a prefill) is not supported", param=f"messages[{len(req.messages) - 1}].role")
    names = [t.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be unique", param="tools")
    for i, tool in enumerate(req.tools or ()):
        if tool.input_schema.get("type", "object") != "object":
            raise InvalidRequest("a tool's input_schema must be a JSON schema of type object",
                                 param=f"tools[{i}].input_schema")
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise InvalidRequest(f"tool_choice names the tool {choice.name!r}, which is not in tools",
                             param="tool_choice.name")


def _check_readable(block: Block, at: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        kind = "image" if isinstance(block, ImageBlock) else "document"
        raise InvalidRequest(f"{kind} blocks are not supported: the model served reads text only", param=at)


# ---- the chat request it is ------------------------------------------------------------------------------

def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request a Messages request means: the system prompt as a system message, tool_use blocks
    as the assistant's tool_calls, each tool_result as a tool message (in order, text around them as user
    messages), tools as functions with input_schema as parameters; tool_choice any -> required, tool ->
    that function, none -> none; disable_parallel_tool_use -> parallel_tool_calls false."""
    messages: list[ChatMessage] = []
    if req.system is not None:
        messages.append(ChatMessage(role="system", content=_parts(req.system)))
    for msg in req.messages:
        messages += _assistant(msg.content) if msg.role == "assistant" else _user(msg.content)
    tools = [Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description,
                                                               parameters=t.input_schema, strict=t.strict))
             for t in req.tools or ()] or None
    choice, parallel = _tool_choice(req.tool_choice)
    chat = ChatCompletionRequest(model=req.model, messages=messages, tools=tools, tool_choice=choice,
                                 parallel_tool_calls=parallel)
    if not isinstance(req, MessagesRequest):
        return chat
    chat = msgspec.structs.replace(chat, max_completion_tokens=req.max_tokens, temperature=req.temperature,
                                   top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=req.stream)
    if isinstance(req.thinking, ThinkingEnabled):
        chat = msgspec.structs.replace(chat, thinking_budget=req.thinking.budget_tokens)
    elif isinstance(req.thinking, ThinkingDisabled):        # a template that can leaves the section out;
        chat = msgspec.structs.replace(chat, thinking_budget=0,   # for one that cannot, it closes at once
                                       chat_template_kwargs={"enable_thinking": False})
    fmt = req.output_config.format if req.output_config is not None else None
    if (fmt := fmt or req.output_format) is not None:
        chat = msgspec.structs.replace(chat, response_format=ResponseFormat(
            type="json_schema", json_schema=JsonSchemaFormat(name="output", schema=fmt.schema)))
    return chat


def _parts(content: str | list[TextBlock]) -> str | list[ContentPart]:
    return content if isinstance(content, str) else [ContentPart(type="text", text=b.text) for b in content]


def _user(content: str | list[Block]) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    out, texts = [], []
    for block in content:
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append(ChatMessage(role="user", content=_parts(texts)))
                texts = []
            out.append(ChatMessage(role="tool", content=_result_text(block), tool_call_id=block.tool_use_id))
    if texts or not out:
        out.append(ChatMessage(role="user", content=_parts(texts)))
    return out


def _result_text(block: ToolResultBlock) -> str:
    """A tool result's text; an error result says so first (the prompt has no other way to)."""
    content = block.content
    text = content if isinstance(content, str) else "\n".join(b.text for b in content if isinstance(b, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _assistant(content: str | list[Block]) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage(role="assistant", content=content)]
    texts = [b for b in content if isinstance(b, TextBlock)]
    calls = [MessageToolCall(id=b.id, function=ToolCallFunction(name=b.name, arguments=json.dumps(
        b.input, ensure_ascii=False))) for b in content if isinstance(b, ToolUseBlock)]
    return [ChatMessage(role="assistant", content=_parts(texts) if texts else None, tool_calls=calls or None)]


def _tool_choice(choice: ToolChoice | None) -> tuple[Literal["none", "auto", "required"] | NamedToolChoice | None,
                                                      bool]:
    match choice:
        case None:
            return None, True
        case ToolChoiceNone():
            return "none", True
        case ToolChoiceAuto(disable_parallel_tool_use=one):
            return "auto", not one
        case ToolChoiceAny(disable_parallel_tool_use=one):
            return "required", not one
        case ToolChoiceTool(name=name, disable_parallel_tool_use=one):
            return NamedToolChoice(type="function", function=NamedFunction(name=name)), not one
    raise AssertionError(choice)                               # unreachable: the union is closed


def prepare_messages(body: bytes, *, served_model_name: str, max_model_len: int) -> tuple[MessagesRequest,
                                                                                          PreparedChat]:
    """POST /v1/messages: the request, and what the engine runs for it (chat's preparation; a schema it
    refuses is named where the Messages request gave it)."""
    req = decode_messages(body)
    if (where := _format_param(req)) is None:
        return req, prepare_chat_request(chat_request(req), served_model_name=served_model_name,
                                         max_model_len=max_model_len)
    try:
        prep = prepare_chat_request(chat_request(req), served_model_name=served_model_name,
                                    max_model_len=max_model_len)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param=f"{where}.schema") if _chats(exc.param) else exc from None
    if prep.constraint is not None and _chats(prep.constraint.param):   # checked against the vocabulary later
        prep = dataclasses.replace(prep, constraint=dataclasses.replace(prep.constraint, param=f"{where}.schema"))
    return req, prep


def _chats(param: str | None) -> bool:
    return (param or "").startswith("response_format")


def prepare_count_tokens(body: bytes, *, served_model_name: str, max_model_len: int) -> PreparedChat:
    """POST /v1/messages/count_tokens: the prompt a Messages request would run (its messages, functions)."""
    return prepare_chat_request(chat_request(decode_count_tokens(body)), served_model_name=served_model_name,
                                max_model_len=max_model_len)
