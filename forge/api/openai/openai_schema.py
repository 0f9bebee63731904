"""The HTTP wire schema of forge's OpenAI-compatible API: request Structs and their decoders. No I/O and no web
framework here: a decoder takes the body bytes and gives back a typed request or an InvalidRequest that names
the bad field (through forge/api/wire_decode.py). What a request becomes for the engine (sampling params,
constraint, prompts) is forge/api/openai/openai_prepare.py's; response shapes are forge/api/openai/openai_output.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from forge.api.wire_decode import decode_body
from forge.errors import InvalidRequest
from forge.sampling.reasoning import Effort
from forge.sampling.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)

_MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, Meta(ge=0, le=_MAX_INT32)]
ThinkingBudget = Annotated[int, Meta(ge=0, le=_MAX_INT32)]      # tokens a reasoning model may think
MaxTokens = Annotated[int, Meta(ge=1, le=_MAX_INT32)]
NumPromptLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]    # vLLM's: alternatives per prompt token
Temperature = Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=_MAX_INT32)]          # -1 and 0 both mean "no top-k"
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
RepetitionPenalty = Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)]
NumChoices = Annotated[int, Meta(ge=1, le=8)]
MinTokens = Annotated[int, Meta(ge=0, le=_MAX_INT32)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]      # any int64; negatives are seeds too
Priority = Annotated[int, Meta(ge=-(2**31 - 1), le=2**31 - 1)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_LENGTH)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]


class _OpenAIWire(msgspec.Struct, frozen=True, kw_only=True):
    """A request body. Unknown fields are ignored (clients send extras); a null field counts as absent."""


class StreamOptions(_OpenAIWire, frozen=True, kw_only=True):
    include_usage: bool = False


class ContentPart(_OpenAIWire, frozen=True, kw_only=True):
    type: Literal["text"]
    text: str


class ToolCallFunction(_OpenAIWire, frozen=True, kw_only=True):
    name: str
    arguments: str                                            # JSON text, as OpenAI sends it


class MessageToolCall(_OpenAIWire, frozen=True, kw_only=True):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_OpenAIWire, frozen=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None           # None only for an assistant turn
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None          # an assistant turn's calls
    tool_call_id: str | None = None                          # a tool turn: the call it answers


class JsonSchemaFormat(_OpenAIWire, frozen=True, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(_OpenAIWire, frozen=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_OpenAIWire, frozen=True, kw_only=True):
    """vLLM's `structured_outputs` extra: exactly one of json, regex, choice, grammar, json_object."""
    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


class FunctionDefinition(_OpenAIWire, frozen=True, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_OpenAIWire, frozen=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_OpenAIWire, frozen=True, kw_only=True):
    name: str


class NamedToolChoice(_OpenAIWire, frozen=True, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class SamplingExtras(_OpenAIWire, frozen=True, kw_only=True):
    """The sampling parameters every generation request of OpenAI's APIs takes beside its own: completions,
    chat completions and the Responses API (forge/api/responses/responses_schema.py) inherit them, and
    sampling_extras carries them from a Responses request to the chat request it means, so a new one is
    declared here once (and read in forge/api/openai/openai_prepare.py's to_sampling_params)."""

    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_tokens: MinTokens = 0
    ignore_eos: bool = False
    priority: Priority = 0          # vLLM's: lower is scheduled first; a tenant's key bounds it (docs/api.md)


def sampling_extras(req: SamplingExtras) -> dict[str, Any]:
    """The request's SamplingExtras by name, for the request of another wire format it is passed on to."""
    return {name: getattr(req, name) for name in SamplingExtras.__struct_fields__}


class _Sampling(SamplingExtras, frozen=True, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras: the current field and the guided_* ones older clients send
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # forge extras
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    skip_special_tokens: bool = True
    cache_salt: Annotated[str, Meta(min_length=1, max_length=1024)] | None = None   # vLLM's: tenant isolation
    # vLLM's: every prompt token's logprob (the first's null) with this many alternatives; not streamed
    prompt_logprobs: NumPromptLogprobs | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (and every chunk carries "usage": null)."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling, frozen=True, kw_only=True):
    """POST /v1/completions. prompt: a string, a list of strings, a token list, or a list of token lists."""

    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: Annotated[int, Meta(ge=0, le=_MAX_INT32)] = 16      # 0 only with echo: score the prompt
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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # A reasoning model's thinking section (forge.sampling.reasoning): reasoning_effort as a token budget
    # (EFFORT_BUDGETS), or forge's thinking_budget in tokens, which wins when both are given.
    reasoning_effort: Effort | None = None
    thinking_budget: ThinkingBudget | None = None
    chat_template_kwargs: dict[str, Any] | None = None     # vLLM's: more variables for the chat template

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required", or the name of the function that must be called."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, or its deprecated alias max_tokens; None when neither is set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateRequest(_OpenAIWire, frozen=True, kw_only=True):
    """POST /generate, the legacy endpoint."""

    prompt: str
    max_tokens: MaxTokens = 32


class TokenizeRequest(_OpenAIWire, frozen=True, kw_only=True):
    """POST /tokenize: exactly one of prompt (plain text) or messages (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None                          # rendered with messages, as chat renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_OpenAIWire, frozen=True, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


# ---- decoding -------------------------------------------------------------------------------------------



def decode_completion(body: bytes) -> CompletionRequest:
    """Every decode_* turns a request body into its Struct, or raises InvalidRequest whose param is the JSON
    path of the bad field ("max_tokens", "messages[0].role"; None for the body as a whole). Nothing else."""
    req = decode_body(body, CompletionRequest)
    _check_common(req)
    _check_prompt(req.prompt)
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("best_of is not supported (it may only equal n)", param="best_of")
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    if req.max_tokens == 0 and not req.echo:
        raise InvalidRequest("max_tokens must be at least 1 (0 only with echo: the prompt scored, nothing generated)",
                             param="max_tokens")
    if req.min_tokens > req.max_tokens:
        raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
    return req


def decode_chat(body: bytes) -> ChatCompletionRequest:
    req = decode_body(body, ChatCompletionRequest)
    _check_common(req)
    _check_messages(req.messages, "messages")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    _check_tools(req)
    max_tokens = req.max_new_tokens
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequest("min_tokens must not exceed max_completion_tokens", param="min_tokens")
    return req


def decode_generate(body: bytes) -> GenerateRequest:
    return decode_body(body, GenerateRequest)


def decode_tokenize(body: bytes) -> TokenizeRequest:
    req = decode_body(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("exactly one of prompt or messages is required", param="prompt")
    if req.messages is not None:
        _check_messages(req.messages, "messages")
    return req


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    return decode_body(body, DetokenizeRequest)


def _check_common(req: _Sampling) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if req.prompt_logprobs and req.stream:        # as vLLM: they come in the body only
        raise InvalidRequest("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    for key, bias in (req.logit_bias or {}).items():
        if not key.isdigit() or int(key) > _MAX_INT32:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias} for token {key}",
                                 param="logit_bias")
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema is None):
        raise InvalidRequest("response_format json_schema needs json_schema.schema",
                             param="response_format.json_schema")
    so = req.structured_outputs
    if so is not None and sum(x is not None for x in (so.json, so.regex, so.choice, so.grammar, so.json_object)) != 1:
        raise InvalidRequest("structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                             param="structured_outputs")
    given = [name for name, on in _constraint_fields(req) if on]
    if len(given) > 1:
        raise InvalidRequest(f"only one output constraint may be given, got {', '.join(given)}", param=given[1])


def _constraint_fields(req: _Sampling) -> list[tuple[str, bool]]:
    rf = req.response_format
    fields = [("response_format", rf is not None and rf.type != "text"),
              ("structured_outputs", req.structured_outputs is not None),
              ("guided_json", req.guided_json is not None), ("guided_regex", req.guided_regex is not None),
              ("guided_choice", req.guided_choice is not None), ("guided_grammar", req.guided_grammar is not None)]
    if isinstance(req, ChatCompletionRequest):
        fields.append(("tool_choice", req.tool_mode not in ("none", "auto")))
    return fields


def _check_tools(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool function names must be unique", param="tools")
    choice = req.tool_choice
    if choice is not None and choice != "none" and not names:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                             param="tool_choice.function.name")
    for i, tool in enumerate(req.tools or ()):
        if tool.function.parameters is not None and tool.function.parameters.get("type", "object") != "object":
            raise InvalidRequest("a function's parameters must be a JSON schema of type object",
                                 param=f"tools[{i}].function.parameters")


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
        if msg.tool_calls and msg.role != "assistant":
            raise InvalidRequest("only assistant messages carry tool_calls", param=f"{param}[{i}].tool_calls")
