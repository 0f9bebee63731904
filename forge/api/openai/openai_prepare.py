"""What a decoded request becomes for the engine: its sampling params (its output constraint among them, as
grammar text), its prompts or chat-template messages, and the functions a chat shows the model. One
prepare_* per route, pure: the gateway checks the constraint against the vocabulary (off the event loop)
and submits the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from forge.api.openai.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    Tool,
    decode_chat,
    decode_completion,
    decode_generate,
)
from forge.errors import RequestError
from forge.sampling.nesting import check_schema
from forge.sampling.reasoning import EFFORT_BUDGETS
from forge.sampling.sampling_params import SamplingParams
from forge.sampling.structured import (
    CLOSE_WITHIN,
    choice_grammar,
    json_object_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)
from forge.text.tool_calls import Function, messages_with_tools, tool_call_grammar


def check_model(model: str | None, served_model_name: str) -> None:
    """A request may name the served model, or none; any other is a 404 (model_not_found)."""
    if model is not None and model != served_model_name:
        raise RequestError(f"the model '{model}' does not exist", param="model", status=404, code="model_not_found")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's output constraint: llguidance grammar text, the field it came from (for errors), and
    whether its output is JSON, which the runner closes within max_tokens (SamplingParams.close_within)."""
    grammar: str
    param: str
    json: bool = False


@dataclass(frozen=True, slots=True)
class PreparedCompletion:
    request: CompletionRequest
    params: SamplingParams               # the constraint's grammar included
    constraint: Constraint | None        # to check against the vocabulary before submitting
    prompts: list[str | list[int]]       # one per prompt: text or token ids


@dataclass(frozen=True, slots=True)
class PreparedChat:
    request: ChatCompletionRequest
    params: SamplingParams
    constraint: Constraint | None
    messages: list[dict[str, Any]]       # as chat templates expect them
    functions: list[Function]            # the tools shown to the model (none under tool_choice "none")
    thinking_budget: int | None = None   # most tokens a reasoning model may think (None: no bound)


def prepare_generate(body: bytes) -> tuple[GenerateRequest, SamplingParams]:
    """POST /generate: greedy, as the seed's endpoint was."""
    req = decode_generate(body)
    return req, SamplingParams(max_tokens=req.max_tokens, temperature=0.0)


def prepare_completion(body: bytes, *, served_model_name: str) -> PreparedCompletion:
    """POST /v1/completions. Raises a RequestError for a bad body, another model, or a constraint that
    llguidance cannot read."""
    req = decode_completion(body)
    check_model(req.model, served_model_name)
    constraint = request_constraint(req)
    params = to_sampling_params(req, default_max_tokens=16, constraint=constraint)
    return PreparedCompletion(req, params, constraint, completion_prompts(req))


def prepare_chat(body: bytes, *, served_model_name: str, max_model_len: int) -> PreparedChat:
    """POST /v1/chat/completions; without a limit a reply may fill the context."""
    return prepare_chat_request(decode_chat(body), served_model_name=served_model_name, max_model_len=max_model_len)


def prepare_chat_request(req: ChatCompletionRequest, *, served_model_name: str, max_model_len: int) -> PreparedChat:
    """A decoded chat request (of any wire format that maps onto one) -> what the engine runs."""
    check_model(req.model, served_model_name)
    constraint = request_constraint(req)
    params = to_sampling_params(req, default_max_tokens=max(1, max_model_len), constraint=constraint)
    return PreparedChat(req, params, constraint, chat_template_messages(req.messages), request_functions(req),
                        thinking_budget(req))


def thinking_budget(req: ChatCompletionRequest) -> int | None:
    """The request's bound on a thinking section: thinking_budget, else reasoning_effort's budget."""
    if req.thinking_budget is not None:
        return req.thinking_budget
    return EFFORT_BUDGETS[req.reasoning_effort] if req.reasoning_effort is not None else None


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


def chat_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: {"role", "content"[, "name", "tool_calls", "tool_call_id"]},
    text parts joined by "\\n", each call's arguments parsed from JSON text (as templates read them)."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg.content is None:
            content = ""
        elif isinstance(msg.content, str):
            content = msg.content
        else:
            content = "\n".join(part.text for part in msg.content)
        entry: dict[str, Any] = {"role": msg.role, "content": content}
        if msg.name is not None:
            entry["name"] = msg.name
        if msg.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in msg.tool_calls]
        if msg.tool_call_id is not None:
            entry["tool_call_id"] = msg.tool_call_id
        out.append(entry)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):     # RecursionError: nested past Python's limit, kept as the text
        return text


def request_functions(req: ChatCompletionRequest) -> list[Function]:
    """The tools shown to the model: none under tool_choice "none"."""
    return [] if req.tool_mode == "none" else functions(req.tools)


def functions(tools: list[Tool] | None) -> list[Function]:
    """The request's tools as functions; a parameter schema nested deeper than MAX_SCHEMA_DEPTH is refused
    here, before a chat template or a grammar reads it (whatever tool_choice says)."""
    for i, t in enumerate(tools or ()):
        if t.function.parameters is not None:
            check_schema(t.function.parameters, param=f"tools[{i}].function.parameters")
    return [Function(t.function.name, t.function.description, t.function.parameters, bool(t.function.strict))
            for t in tools or ()]


def request_constraint(req: CompletionRequest | ChatCompletionRequest) -> Constraint | None:
    """The request's constraint as a grammar (decode_* allowed at most one). Raises InvalidRequest for a
    schema, regex or grammar that llguidance cannot even read; whether it compiles against the vocabulary
    is Grammars.check's to say."""
    if isinstance(req, ChatCompletionRequest):
        mode = req.tool_mode
        if mode not in ("none", "auto"):
            functions = [f for f in request_functions(req) if mode == "required" or f.name == mode]
            return Constraint(tool_call_grammar(functions, parallel=req.parallel_tool_calls and mode == "required",
                                                param="tools"), "tools", json=True)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        return Constraint(json_object_grammar(), "response_format", json=True)
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        return Constraint(json_schema_grammar(rf.json_schema.schema, strict=bool(rf.json_schema.strict),
                                              param="response_format.json_schema.schema"),
                          "response_format.json_schema.schema", json=True)
    so = req.structured_outputs
    if so is not None:
        ws = so.whitespace_pattern
        if so.json is not None:
            return Constraint(json_schema_grammar(so.json, whitespace_pattern=ws, param="structured_outputs.json"),
                              "structured_outputs.json", json=True)
        if so.json_object:
            return Constraint(json_schema_grammar({"type": "object"}, whitespace_pattern=ws,
                                                  param="structured_outputs.json_object"), "structured_outputs",
                              json=True)
        if so.regex is not None:
            return Constraint(regex_grammar(so.regex, param="structured_outputs.regex"), "structured_outputs.regex")
        if so.choice is not None:
            return Constraint(choice_grammar(so.choice, param="structured_outputs.choice"),
                              "structured_outputs.choice")
        if so.grammar is not None:
            return Constraint(lark_grammar(so.grammar, param="structured_outputs.grammar"),
                              "structured_outputs.grammar")
    if req.guided_json is not None:
        return Constraint(json_schema_grammar(req.guided_json, whitespace_pattern=req.guided_whitespace_pattern,
                                              param="guided_json"), "guided_json", json=True)
    if req.guided_regex is not None:
        return Constraint(regex_grammar(req.guided_regex, param="guided_regex"), "guided_regex")
    if req.guided_choice is not None:
        return Constraint(choice_grammar(req.guided_choice, param="guided_choice"), "guided_choice")
    if req.guided_grammar is not None:
        return Constraint(lark_grammar(req.guided_grammar, param="guided_grammar"), "guided_grammar")
    return None


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, *, default_max_tokens: int,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """The request's sampling settings. default_max_tokens (the room left in the context) applies only where
    the request sets no limit (chat without max_completion_tokens/max_tokens); it never clamps a set limit.
    constraint: the request's (request_constraint), if any; a JSON one closes within the limit."""
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_new_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if max_tokens is None:
        max_tokens = max(default_max_tokens, req.min_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
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
        prompt_logprobs=prompt_logprobs(req),
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=tuple((int(k), float(v)) for k, v in (req.logit_bias or {}).items()),
        grammar=constraint.grammar if constraint else None,
        close_within=min(CLOSE_WITHIN, max_tokens // 4) if constraint is not None and constraint.json else 0,
        cache_salt=req.cache_salt,
        priority=req.priority,
    )


def prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives each prompt token's logprob comes with, or None when nothing asks for them:
    vLLM's prompt_logprobs (not streamed: a stream leaves them out), and on completions echo with logprobs
    (the echoed prompt's tokens carry theirs, as OpenAI's legacy completions did and vLLM does)."""
    asked = [req.prompt_logprobs] if req.prompt_logprobs is not None and not req.stream else []
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        asked.append(req.logprobs)
    return max(asked, default=None)


def template_messages(supports_tools: bool, entries: list[dict[str, Any]], functions: list[Function],
                      ) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None]:
    """Messages (and tools) as the chat template gets them: a template that reads tools renders them and
    tool turns itself (`supports_tools`); for any other, tools and tool turns are written in forge's format."""
    if supports_tools:
        return tuple(entries), tuple(f.as_tool() for f in functions) or None
    if functions or any(m["role"] == "tool" or "tool_calls" in m for m in entries):
        entries = messages_with_tools(entries, functions)
    return tuple(entries), None
