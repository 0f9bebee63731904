"""The wire schema of forge's Ollama-compatible API (POST /api/chat, /api/generate, /api/embed,
/api/embeddings, /api/show): request Structs, their decoders, and the converter to the chat request the
same pipeline runs. An Ollama chat is another wire format over a chat request: its sampling, chat template,
tools and constraints are chat's (forge/api/openai/openai_prepare.py), so the two give the same output for
the same settings. Unknown fields and options are ignored, and a null counts as absent, as on every forge
route; what forge cannot do (images, a template of the request's own, suffix, context) is a 400. Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from forge.api.openai.openai_prepare import PreparedChat, prepare_chat_request
from forge.api.openai.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    MessageToolCall,
    MinP,
    Penalty,
    RepetitionPenalty,
    ResponseFormat,
    Seed,
    StopString,
    Temperature,
    Tool,
    ToolCallFunction,
    TopP,
)
from forge.api.wire_decode import decode_body
from forge.errors import InvalidRequest
from forge.sampling.sampling_params import MAX_STOP_STRINGS

_MAX_INT32 = 2**31 - 1
# Ollama's own defaults (its Modelfile parameters) where forge's chat defaults differ; repeat_penalty's 1.1
# is not one of them: forge's penalty weighs every earlier token, not Ollama's last 64, so it stays off.
DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K = 0.8, 0.9, 40
NumPredict = Annotated[int, Meta(ge=-2, le=_MAX_INT32)]        # -1: no limit, -2: fill the context
Effort = Literal["low", "medium", "high"]
# `format`, when a JSON schema, kept as sent: in a schema null is a value (`"const": null`)
_FORMAT = frozenset({"format"})


class _OllamaWire(msgspec.Struct, frozen=True, kw_only=True):
    """A request body's part. Unknown fields are ignored (Ollama's server ignores them too)."""


class OllamaOptions(_OllamaWire, frozen=True, kw_only=True):
    """`options`: the sampling settings forge has. The runtime ones of llama.cpp (num_gpu, num_thread,
    num_batch, use_mmap, ...) and those forge has no sampler for (mirostat, tfs_z, typical_p,
    repeat_last_n, penalize_newline, num_keep) are accepted and ignored, as unknown fields are."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, le=_MAX_INT32)] | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    num_predict: NumPredict | None = None
    num_ctx: Annotated[int, Meta(ge=1, le=_MAX_INT32)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None


class OllamaCallFunction(_OllamaWire, frozen=True, kw_only=True):
    name: str
    arguments: dict[str, Any] = {}                       # an object, not JSON text (Ollama's shape)


class OllamaToolCall(_OllamaWire, frozen=True, kw_only=True):
    function: OllamaCallFunction


class OllamaMessage(_OllamaWire, frozen=True, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None                          # an earlier turn's; the prompt does not repeat it
    images: list[str] | None = None                      # refused: the models forge serves read text
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None                         # a tool turn: which tool answered


class _Generating(_OllamaWire, frozen=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    stream: bool = True                                  # Ollama streams unless told not to
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: OllamaOptions = OllamaOptions()
    keep_alive: float | str | None = None                # read by the model resolver before decoding
    think: bool | Effort | None = None


class OllamaChat(_Generating, frozen=True, kw_only=True):
    """POST /api/chat."""

    messages: list[OllamaMessage] = []
    tools: list[Tool] | None = None                      # OpenAI's shape: {"type": "function", "function": ...}


class OllamaGenerate(_Generating, frozen=True, kw_only=True):
    """POST /api/generate: a prompt through the chat template (with `system`), or `raw` as it is."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    images: list[str] | None = None


class OllamaEmbed(_OllamaWire, frozen=True, kw_only=True):
    """POST /api/embed."""

    model: Annotated[str, Meta(min_length=1)]
    input: str | list[str]
    truncate: bool = True
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    options: OllamaOptions = OllamaOptions()
    keep_alive: float | str | None = None


class OllamaEmbeddings(_OllamaWire, frozen=True, kw_only=True):
    """POST /api/embeddings, the older one-prompt form."""

    model: Annotated[str, Meta(min_length=1)]
    prompt: str
    options: OllamaOptions = OllamaOptions()
    keep_alive: float | str | None = None


class OllamaShow(_OllamaWire, frozen=True, kw_only=True):
    """POST /api/show: `model`, or `name` as older clients send it."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False

    @property
    def model_name(self) -> str:
        name = self.model or self.name
        if not name:
            raise InvalidRequest("missing required field 'model'", param="model")
        return name


# ---- decoding -------------------------------------------------------------------------------------------

def decode_chat(body: bytes) -> OllamaChat:
    """A body -> its request, or InvalidRequest naming the bad field ("messages[0].role")."""
    req = decode_body(body, OllamaChat, schema_keys=_FORMAT)
    for i, msg in enumerate(req.messages):
        if msg.images:
            raise _images(f"messages[{i}].images")
        if msg.tool_calls and msg.role != "assistant":
            raise InvalidRequest("only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool function names must be unique", param="tools")
    return req


def decode_generate(body: bytes) -> OllamaGenerate:
    req = decode_body(body, OllamaGenerate, schema_keys=_FORMAT)
    if req.images:
        raise _images("images")
    if req.suffix:
        raise InvalidRequest("suffix is not supported: the models forge serves are not run fill-in-the-middle",
                             param="suffix")
    if req.template:
        raise InvalidRequest("template is not supported: forge renders prompts with the model's own chat "
                             "template (or none, with raw)", param="template")
    if req.context:
        raise InvalidRequest("context is not supported: send the conversation as messages to /api/chat",
                             param="context")
    return req


def decode_embed(body: bytes) -> OllamaEmbed:
    req = decode_body(body, OllamaEmbed)
    if req.input == "" or req.input == []:
        raise InvalidRequest("input must not be empty", param="input")
    return req


def decode_embeddings(body: bytes) -> OllamaEmbeddings:
    req = decode_body(body, OllamaEmbeddings)
    if not req.prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return req


def decode_show(body: bytes) -> OllamaShow:
    return decode_body(body, OllamaShow)


def _images(param: str) -> InvalidRequest:
    return InvalidRequest("images are not supported: the models forge serves read text only", param=param)


# ---- the chat request it is ------------------------------------------------------------------------------

def chat_request(req: OllamaChat | OllamaGenerate, *, max_model_len: int) -> ChatCompletionRequest:
    """The chat request an Ollama request means: its messages (for /api/generate: `system`, then the prompt
    as the user's), tool calls with their arguments as JSON text and each tool turn answering the latest
    call of its tool, options as chat's sampling fields (Ollama's defaults for temperature, top_p and top_k
    where unset), `format` as response_format, `think` false as a thinking budget of 0 and a low, medium
    or high effort as reasoning_effort. The model is left out: the resolver has found it by name."""
    opts = req.options
    if isinstance(req, OllamaChat):
        messages = chat_messages(req.messages)
        tools = req.tools
    else:
        messages = [ChatMessage(role="system", content=req.system)] if req.system else []
        messages.append(ChatMessage(role="user", content=req.prompt))
        tools = None
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    stop = [opts.stop] if isinstance(opts.stop, str) else opts.stop
    chat = ChatCompletionRequest(
        messages=messages, tools=tools, stream=req.stream, stop=stop,
        max_completion_tokens=max_tokens(opts, max_model_len=max_model_len),
        temperature=DEFAULT_TEMPERATURE if opts.temperature is None else opts.temperature,
        top_p=DEFAULT_TOP_P if opts.top_p is None else opts.top_p,
        top_k=DEFAULT_TOP_K if opts.top_k is None else opts.top_k,
        min_p=opts.min_p or 0.0, seed=opts.seed, repetition_penalty=opts.repeat_penalty or 1.0,
        presence_penalty=opts.presence_penalty or 0.0, frequency_penalty=opts.frequency_penalty or 0.0,
        response_format=response_format(req.format))
    if req.think is False:                       # a template that can leaves the section out;
        chat = msgspec.structs.replace(chat, thinking_budget=0,      # for one that cannot, it closes at once
                                       chat_template_kwargs={"enable_thinking": False})
    elif isinstance(req.think, str):
        chat = msgspec.structs.replace(chat, reasoning_effort=req.think)
    return chat


def max_tokens(opts: OllamaOptions, *, max_model_len: int) -> int | None:
    """num_predict as chat's limit (-1 and -2: none, so the context bounds it); num_ctx above the model's
    context is refused, and below it bounds the output when num_predict does not."""
    if opts.num_ctx is not None and opts.num_ctx > max_model_len:
        raise InvalidRequest(f"options.num_ctx {opts.num_ctx} is more than this model's context of "
                             f"{max_model_len} tokens (the server's --max-model-len)", param="options.num_ctx")
    if opts.num_predict == 0:
        raise InvalidRequest("options.num_predict must be at least 1 (or -1: up to the context)",
                             param="options.num_predict")
    if opts.num_predict is not None and opts.num_predict > 0:
        return opts.num_predict
    return opts.num_ctx


def response_format(fmt: str | dict[str, Any] | None) -> ResponseFormat | None:
    """`format`: "json" as any JSON object, a JSON schema as that schema (strictly), "" as none."""
    if fmt == "json":
        return ResponseFormat(type="json_object")
    if isinstance(fmt, dict):
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="format", schema=fmt,
                                                                                strict=True))
    return None


def chat_messages(messages: list[OllamaMessage]) -> list[ChatMessage]:
    """Ollama's messages as chat's: an assistant's calls get ids (`call_<i>`, Ollama sends none), and a tool
    turn answers the latest call of the tool it names (or the latest call, when it names none)."""
    out: list[ChatMessage] = []
    calls: list[tuple[str, str]] = []                    # (id, name) of every call so far
    for msg in messages:
        if msg.role == "assistant" and msg.tool_calls:
            made = []
            for call in msg.tool_calls:
                call_id = f"call_{len(calls)}"
                calls.append((call_id, call.function.name))
                made.append(MessageToolCall(id=call_id, function=ToolCallFunction(
                    name=call.function.name, arguments=json.dumps(call.function.arguments, ensure_ascii=False))))
            out.append(ChatMessage(role="assistant", content=msg.content or None, tool_calls=made))
        elif msg.role == "tool":
            named = [cid for cid, name in calls if msg.tool_name in (None, name)]
            out.append(ChatMessage(role="tool", content=msg.content, name=msg.tool_name,
                                   tool_call_id=named[-1] if named else None))
        else:
            out.append(ChatMessage(role=msg.role, content=msg.content))
    return out


def prepare_chat(req: OllamaChat | OllamaGenerate, *, served_model_name: str, max_model_len: int) -> PreparedChat:
    """What the engine runs for a decoded /api/chat or (not raw) /api/generate request (chat's preparation)."""
    return prepare_chat_request(chat_request(req, max_model_len=max_model_len), served_model_name=served_model_name,
                                max_model_len=max_model_len)

