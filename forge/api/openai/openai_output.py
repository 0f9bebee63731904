"""Response shapes of forge's OpenAI-compatible API: pure builders of the JSON bodies, stream chunks, logprobs,
error envelopes and the model list, plus SSE framing. Every builder returns plain dicts ready for
msgspec.json.encode; nothing here reads a clock or does I/O (the caller passes `created`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "tool_calls"]     # tool_calls: chat only

SSE_DONE = b"data: [DONE]\n\n"
SSE_PING = b": ping\n\n"

_MIN_LOGPROB = -9999.0  # -inf is not JSON; clients expect a number
_encoder = msgspec.json.Encoder()


class ResponseHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What every body and chunk of one response repeats. include_usage: the stream was asked for usage, so
    every chunk carries "usage": null and the last one carries the counts."""

    request_id: str
    created: int
    model: str
    include_usage: bool = False


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0        # prompt tokens found in the prefix cache
    draft_tokens: int = 0         # speculative decoding: drafts proposed, and of them kept
    accepted_tokens: int = 0
    reasoning_tokens: int = 0     # completion tokens inside a thinking section


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """One token's logprob info: its text, its raw bytes (a token may hold part of a UTF-8 character), its
    logprob, and the top alternatives as (text, bytes, logprob), best first. A prompt token's (echo, vLLM's
    prompt_logprobs) also has its id, its rank and its alternatives' ids; the prompt's first has no logprob."""

    text: str
    token_bytes: bytes
    logprob: float | None
    top: tuple[tuple[str, bytes, float], ...] = ()
    token_id: int | None = None
    rank: int | None = None
    top_ids: tuple[int, ...] = ()


def new_request_id(kind: Literal["cmpl", "chatcmpl"]) -> str:
    """A fresh response id: "cmpl-<32 hex>" or "chatcmpl-<32 hex>"."""
    return f"{kind}-{uuid.uuid4().hex}"


def sse_frame(obj: Any) -> bytes:
    """One server-sent event carrying obj as JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_card(model_id: str, *, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "forge",
        "root": model_id,
        "parent": None,
        "max_model_len": max_model_len,
    }


def model_list(cards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": list(cards)}


def _usage(usage: Usage) -> dict[str, Any]:
    """The usage object of every response and usage chunk, completions and chat alike: token counts,
    the prompt tokens served from the prefix cache, and when speculative decoding ran, its drafts
    kept and rejected (OpenAI's prediction-token fields)."""
    total = usage.prompt_tokens + usage.completion_tokens
    details: dict[str, int] = {"reasoning_tokens": usage.reasoning_tokens}
    if usage.draft_tokens:
        details["accepted_prediction_tokens"] = usage.accepted_tokens
        details["rejected_prediction_tokens"] = usage.draft_tokens - usage.accepted_tokens
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens, "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}, "completion_tokens_details": details}


# ---- logprobs -------------------------------------------------------------------------------------------


def completion_logprobs(entries: Sequence[TokenLogprob], text_offsets: Sequence[int]) -> dict[str, Any]:
    """The legacy completions logprobs object. text_offsets[i]: where entries[i]'s text starts in the
    choice's text (counted in characters, over the echoed prompt too when echo is on). The prompt's first
    token (echoed) has null for its logprob and its alternatives."""
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [_finite(e.logprob) for e in entries],
        "top_logprobs": [None if e.logprob is None else _top_by_text(e.top) for e in entries],
        "text_offset": list(text_offsets),
    }


def prompt_logprobs(entries: Sequence[TokenLogprob], num_top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}},
    the token itself first, then its num_top likeliest alternatives ranked 1, 2, ... (the token among them
    keeps its place and takes their rank)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        scored = {str(e.token_id): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": e.text}}
        for rank, (token_id, (text, _, lp)) in enumerate(zip(e.top_ids, e.top[:num_top], strict=False), start=1):
            scored[str(token_id)] = {"logprob": _finite(lp), "rank": rank, "decoded_token": text}
        out.append(scored)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    return {
        "content": [
            {
                "token": e.text,
                "logprob": _finite(e.logprob),
                "bytes": list(e.token_bytes),
                "top_logprobs": [
                    {"token": text, "logprob": _finite(lp), "bytes": list(raw)} for text, raw, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def _top_by_text(top: tuple[tuple[str, bytes, float], ...]) -> dict[str, float | None]:
    """{text: logprob}, best first; where two alternatives share a text, the better one (listed first) wins."""
    out: dict[str, float | None] = {}
    for text, _, lp in top:
        out.setdefault(text, _finite(lp))
    return out


def _finite(logprob: float | None) -> float | None:
    """A JSON-safe logprob: -inf and nan become the floor -9999.0; None (the prompt's first token) stays."""
    if logprob is None:
        return None
    value = float(logprob)
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB


# ---- completions ----------------------------------------------------------------------------------------


def completion_choice(
    index: int, text: str, finish_reason: FinishReason, logprobs: dict[str, Any] | None = None,
    prompt_logprobs: list[Any] | None = None,
) -> dict[str, Any]:
    """A completion choice; `prompt_logprobs` (vLLM's, prompt_logprobs() above) only when the request asked."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def completion_response(
    header: ResponseHeader, choices: Sequence[dict[str, Any]], usage: Usage
) -> dict[str, Any]:
    return {**_completion_envelope(header), "choices": list(choices), "usage": _usage(usage)}


def completion_chunk(
    header: ResponseHeader,
    *,
    index: int,
    text: str,
    finish_reason: FinishReason | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_null_usage(header, {**_completion_envelope(header), "choices": [choice]})


def completion_usage_chunk(header: ResponseHeader, usage: Usage) -> dict[str, Any]:
    return {**_completion_envelope(header), "choices": [], "usage": _usage(usage)}


def _completion_envelope(header: ResponseHeader) -> dict[str, Any]:
    return {
        "id": header.request_id,
        "object": "text_completion",
        "created": header.created,
        "model": header.model,
        "system_fingerprint": None,
    }


# ---- chat completions -----------------------------------------------------------------------------------


def chat_choice(
    index: int, content: str | None, finish_reason: FinishReason, logprobs: dict[str, Any] | None = None,
    tool_calls: Sequence[dict[str, Any]] = (), *, reasoning: str | None = None,
) -> dict[str, Any]:
    """A chat choice; `reasoning` (a reasoning model's thinking section) is message.reasoning_content, the
    field vLLM and other OpenAI-compatible servers use, present only when there is a section."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None,
                               "tool_calls": list(tool_calls)}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of message.tool_calls: arguments is JSON text."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tool_call_chunk(header: ResponseHeader, *, index: int, call_index: int, call_id: str | None = None,
                         name: str | None = None, arguments: str = "") -> dict[str, Any]:
    """A tool call's first chunk (id, type, name, "" arguments), or a fragment of its arguments."""
    entry: dict[str, Any] = {"index": call_index}
    if call_id is not None:
        entry.update(id=call_id, type="function", function={"name": name, "arguments": arguments})
    else:
        entry["function"] = {"arguments": arguments}
    return _chat_chunk(header, index, {"tool_calls": [entry]}, None, None)


def chat_response(header: ResponseHeader, choices: Sequence[dict[str, Any]], usage: Usage,
                  prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
    """A chat completion; `prompt_logprobs` (vLLM's, the one prompt's, beside the choices as vLLM puts it)
    only when the request asked."""
    body = {
        "id": header.request_id,
        "object": "chat.completion",
        "created": header.created,
        "model": header.model,
        "system_fingerprint": None,
        "choices": list(choices),
        "usage": _usage(usage),
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def chat_role_chunk(header: ResponseHeader, *, index: int) -> dict[str, Any]:
    """The first chunk of each choice: the role, and empty content."""
    return _chat_chunk(header, index, {"role": "assistant", "content": ""}, None, None)


def chat_content_chunk(
    header: ResponseHeader, *, index: int, content: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return _chat_chunk(header, index, {"content": content}, logprobs, None)


def chat_reasoning_chunk(
    header: ResponseHeader, *, index: int, reasoning: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A piece of a reasoning model's thinking section: delta.reasoning_content."""
    return _chat_chunk(header, index, {"reasoning_content": reasoning}, logprobs, None)


def chat_finish_chunk(header: ResponseHeader, *, index: int, finish_reason: FinishReason) -> dict[str, Any]:
    """The last chunk of each choice: an empty delta and the finish reason."""
    return _chat_chunk(header, index, {}, None, finish_reason)


def chat_usage_chunk(header: ResponseHeader, usage: Usage) -> dict[str, Any]:
    """After every choice finished, only with include_usage: no choices, the whole request's usage."""
    return {**_chat_chunk_envelope(header), "choices": [], "usage": _usage(usage)}


def _chat_chunk(
    header: ResponseHeader,
    index: int,
    delta: dict[str, Any],
    logprobs: dict[str, Any] | None,
    finish_reason: FinishReason | None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_null_usage(header, {**_chat_chunk_envelope(header), "choices": [choice]})


def _chat_chunk_envelope(header: ResponseHeader) -> dict[str, Any]:
    return {
        "id": header.request_id,
        "object": "chat.completion.chunk",
        "created": header.created,
        "model": header.model,
    }


def _with_null_usage(header: ResponseHeader, chunk: dict[str, Any]) -> dict[str, Any]:
    if header.include_usage:
        chunk["usage"] = None
    return chunk
