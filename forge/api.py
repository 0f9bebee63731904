"""The HTTP wire schema of forge's OpenAI-compatible API: request Structs, their decoders, and pure converters
from a decoded request to SamplingParams and to chat-template messages. No I/O and no web framework here: the
gateway hands in the body bytes and gets back a typed request or an InvalidRequest that names the bad field.
Response shapes live in forge/api_responses.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from forge.errors import InvalidRequest
from forge.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams

_MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, Meta(ge=0, le=_MAX_INT32)]
MaxTokens = Annotated[int, Meta(ge=1, le=_MAX_INT32)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=_MAX_INT32)]          # -1 and 0 both mean "no top-k"
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
NumChoices = Annotated[int, Meta(ge=1, le=8)]
MinTokens = Annotated[int, Meta(ge=0, le=_MAX_INT32)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]      # any int64; negatives are seeds too
Stop = str | Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)]


class _Wire(msgspec.Struct, frozen=True, kw_only=True):
    """A request body. Unknown fields are ignored (clients send extras); a null field counts as absent."""


class StreamOptions(_Wire, frozen=True, kw_only=True):
    include_usage: bool = False


class ContentPart(_Wire, frozen=True, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessage(_Wire, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None           # None only for an assistant turn
    name: str | None = None


class ResponseFormat(_Wire, frozen=True, kw_only=True):
    type: str


class _Sampling(_Wire, frozen=True, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Seed | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # forge extras
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = []
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (and every chunk carries "usage": null)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    """POST /v1/completions. prompt: a string, a list of strings, a token list, or a list of token lists."""

    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: MaxTokens = 16
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling, frozen=True, kw_only=True):
    """POST /v1/chat/completions. max_tokens is the deprecated alias of max_completion_tokens."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None


class GenerateRequest(_Wire, frozen=True, kw_only=True):
    """POST /generate, the legacy endpoint."""

    prompt: str
    max_tokens: MaxTokens = 32


class TokenizeRequest(_Wire, frozen=True, kw_only=True):
    """POST /tokenize: exactly one of prompt (plain text) or messages (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Wire, frozen=True, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


# ---- decoding -------------------------------------------------------------------------------------------

_W = TypeVar("_W", bound=_Wire)
_AT_PATH = re.compile(r"^(?P<detail>.*?) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]*)`$")
_NULL_DEPTH = 5  # body -> messages -> message -> content -> part: nulls count as absent down to parts


def decode_completion(body: bytes) -> CompletionRequest:
    """Every decode_* turns a request body into its Struct, or raises InvalidRequest whose param is the JSON
    path of the bad field ("max_tokens", "messages[0].role"; None for the body as a whole). Nothing else."""
    req = _decode(body, CompletionRequest)
    _check_common(req)
    _check_prompt(req.prompt)
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of is not supported (it may only equal n)", param="best_of")
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.min_tokens > req.max_tokens:
        raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
    return req


def decode_chat(body: bytes) -> ChatCompletionRequest:
    req = _decode(body, ChatCompletionRequest)
    _check_common(req)
    _check_messages(req.messages, "messages")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequest(
            f"response_format type {req.response_format.type!r} is not supported", param="response_format.type"
        )
    if req.tools:
        raise InvalidRequest("tools are not supported", param="tools")
    if req.tool_choice is not None and req.tool_choice not in ("none", "auto"):
        raise InvalidRequest("tool_choice is not supported", param="tool_choice")
    max_tokens = _chat_max_tokens(req)
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequest("min_tokens must not exceed max_completion_tokens", param="min_tokens")
    return req


def decode_generate(body: bytes) -> GenerateRequest:
    return _decode(body, GenerateRequest)


def decode_tokenize(body: bytes) -> TokenizeRequest:
    req = _decode(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("exactly one of prompt or messages is required", param="prompt")
    if req.messages is not None:
        _check_messages(req.messages, "messages")
    return req


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    return _decode(body, DetokenizeRequest)


def _decode(body: bytes, kind: type[_W]) -> _W:
    """Bytes -> a validated Struct, or InvalidRequest. Never raises anything else."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    try:
        raw = msgspec.json.decode(body)
        return msgspec.convert(_drop_nulls(raw, _NULL_DEPTH), kind)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None


def _drop_nulls(obj: Any, depth: int) -> Any:
    """Remove null-valued keys from objects, so that `"n": null` means the same as leaving n out."""
    if depth <= 0:
        return obj
    if isinstance(obj, dict):
        return {k: _drop_nulls(v, depth - 1) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nulls(v, depth - 1) for v in obj]
    return obj


def _invalid(message: str) -> InvalidRequest:
    """Turn msgspec's "<detail> - at `$.a[0].b`" into a message plus the param "a[0].b"."""
    detail, path = message, ""
    if m := _AT_PATH.match(message):
        detail, path = m["detail"], m["path"].removeprefix(".")
    if m := _MISSING.match(detail):
        param = f"{path}.{m['field']}" if path else m["field"]
        return InvalidRequest(f"missing required field '{param}'", param=param)
    if not path:
        return InvalidRequest(f"invalid request: {detail}")
    return InvalidRequest(f"invalid '{path}': {detail}", param=path)


def _check_common(req: _Sampling) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if req.logit_bias:
        raise InvalidRequest("logit_bias is not supported", param="logit_bias")


def _check_prompt(prompt: str | list[str | int | list[int]]) -> None:
    """A prompt list must be all strings, all token ids, or all token lists; nothing may be empty."""
    if isinstance(prompt, str) or not prompt:
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return
    first = type(prompt[0])
    for i, item in enumerate(prompt):
        if type(item) is not first:
            raise InvalidRequest(
                "prompt must be a string, a list of strings, a list of token ids or a list of token id lists",
                param=f"prompt[{i}]",
            )
        if first is not int and not item:
            raise InvalidRequest("prompt must not be empty", param=f"prompt[{i}]")


def _check_messages(messages: list[ChatMessage], param: str) -> None:
    for i, msg in enumerate(messages):
        if msg.content is None and msg.role != "assistant":
            raise InvalidRequest(
                f"content is required for a {msg.role} message", param=f"{param}[{i}].content"
            )


# ---- pure converters ------------------------------------------------------------------------------------


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, one per entry: each a string or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [[t for t in prompt if isinstance(t, int)]]  # one token list (the decoder checked homogeneity)
    out: list[str | list[int]] = []
    for p in prompt:
        if isinstance(p, int):
            out.append([p])                                   # unreachable after decoding; keeps types total
        else:
            out.append(p if isinstance(p, str) else list(p))
    return out


def chat_template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them: {"role", "content"[, "name"]}, text parts joined by "\\n"."""
    out: list[dict[str, str]] = []
    for msg in messages:
        if msg.content is None:
            content = ""
        elif isinstance(msg.content, str):
            content = msg.content
        else:
            content = "\n".join(part.text for part in msg.content)
        entry = {"role": msg.role, "content": content}
        if msg.name is not None:
            entry["name"] = msg.name
        out.append(entry)
    return out


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest | GenerateRequest, *, default_max_tokens: int
) -> SamplingParams:
    """The request's sampling settings. default_max_tokens (the room left in the context) applies only where
    the request sets no limit (chat without max_completion_tokens/max_tokens); it never clamps a set limit."""
    if isinstance(req, GenerateRequest):
        return SamplingParams(max_tokens=req.max_tokens)
    if isinstance(req, ChatCompletionRequest):
        max_tokens = _chat_max_tokens(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=float(req.temperature),
        top_p=float(req.top_p),
        top_k=max(req.top_k, 0),
        min_p=float(req.min_p),
        seed=req.seed,
        presence_penalty=float(req.presence_penalty),
        frequency_penalty=float(req.frequency_penalty),
        repetition_penalty=float(req.repetition_penalty),
        stop=tuple(s for s in stop if s),                  # an empty stop string would match everywhere
        stop_token_ids=tuple(req.stop_token_ids),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


def _chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
