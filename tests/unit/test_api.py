"""forge.api.openai.openai_schema: request decoding (every bad input is an InvalidRequest naming its param),
conversion to SamplingParams, and the exact JSON shapes of responses, chunks, logprobs, errors and the model list."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.api.openai import openai_output as wire
from forge.api.openai import openai_schema as api
from forge.api.openai.openai_output import SSE_DONE, SSE_PING, ResponseHeader, TokenLogprob, Usage
from forge.api.openai.openai_prepare import (
    chat_template_messages,
    completion_prompts,
    prepare_generate,
    request_constraint,
    to_sampling_params,
)
from forge.api.openai.openai_schema import (
    decode_chat,
    decode_completion,
    decode_detokenize,
    decode_generate,
    decode_tokenize,
)
from forge.errors import InvalidRequest
from forge.sampling.sampling_params import SamplingParams
from forge.sampling.structured import CLOSE_WITHIN

USER = [{"role": "user", "content": "hi"}]
DECODERS = [decode_completion, decode_chat, decode_generate, decode_tokenize, decode_detokenize]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def completion(**fields: Any) -> api.CompletionRequest:
    return decode_completion(body(**{"prompt": "hi", **fields}))


def chat(**fields: Any) -> api.ChatCompletionRequest:
    return decode_chat(body(**{"messages": USER, **fields}))


def invalid_param(decode: Any, raw: bytes) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        decode(raw)
    assert info.value.message
    return info.value.param


# ---- decoding errors ------------------------------------------------------------------------------------


def test_invalid_json_is_invalid_request() -> None:
    assert invalid_param(decode_completion, b'{"prompt": "hi",') is None
    assert invalid_param(decode_chat, b"") is None


def test_invalid_utf8_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="UTF-8"):
        decode_completion(b'{"prompt": "\xff\xfe"}')


def test_lone_surrogate_escape_is_invalid_request() -> None:
    assert invalid_param(decode_completion, b'{"prompt": "a\\ud800b"}') is None


def test_top_level_must_be_an_object() -> None:
    assert invalid_param(decode_chat, b"[1, 2]") is None


def test_deep_nesting_is_invalid_request() -> None:
    assert invalid_param(decode_chat, b"[" * 100_000) is None
    assert invalid_param(decode_chat, b'{"tools": ' + b"[" * 100_000) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"temperature": 5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 4e-147}, "repetition_penalty"),      # 0 in float32: a division by zero
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [1]}, "stop[0]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"suffix": "tail"}, "suffix"),
        ({"logit_bias": {"50256": -101}}, "logit_bias"),
        ({"logit_bias": {"eos": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "high"}}, "logit_bias"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"best_of": 2}, "best_of"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": ["a", ""]}, "prompt[1]"),
        ({"prompt": ["a", 1]}, "prompt[1]"),
        ({"prompt": [1, [2]]}, "prompt[1]"),
        ({"prompt": [1, -2]}, "prompt[1]"),
        ({"prompt": [[1, True]]}, "prompt[0][1]"),
        ({"prompt": [{"a": 1}]}, "prompt[0]"),
    ],
)
def test_bad_completion_field_names_its_param(fields: dict[str, Any], param: str) -> None:
    assert invalid_param(decode_completion, body(**{"prompt": "hi", **fields})) == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [*USER, {"role": "user"}]}, "messages[1].content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"n": 0}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 2, "logprobs": False}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[0].tool_calls"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_bad_chat_field_names_its_param(fields: dict[str, Any], param: str) -> None:
    assert invalid_param(decode_chat, body(**{"messages": USER, **fields})) == param


def test_missing_required_fields() -> None:
    assert invalid_param(decode_chat, body(model="m")) == "messages"
    assert invalid_param(decode_completion, body(model="m")) == "prompt"
    assert invalid_param(decode_generate, body(max_tokens=3)) == "prompt"
    assert invalid_param(decode_detokenize, body()) == "tokens"


def test_tokenize_needs_exactly_one_of_prompt_and_messages() -> None:
    assert invalid_param(decode_tokenize, body()) == "prompt"
    assert invalid_param(decode_tokenize, body(prompt="a", messages=USER)) == "prompt"
    assert invalid_param(decode_tokenize, body(messages=[{"role": "user"}])) == "messages[0].content"


def test_detokenize_rejects_negative_ids() -> None:
    assert invalid_param(decode_detokenize, body(tokens=[1, -1])) == "tokens[1]"


def test_error_message_is_readable() -> None:
    with pytest.raises(InvalidRequest) as info:
        completion(n=0)
    assert info.value.message == "invalid 'n': Expected `int` >= 1"
    with pytest.raises(InvalidRequest) as info:
        decode_chat(body(messages=[{"content": "x"}]))
    assert info.value.message == "missing required field 'messages[0].role'"


# ---- decoding successes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Paris is", ["Paris is"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_four_prompt_forms_decode(prompt: Any, prompts: list[Any]) -> None:
    req = completion(prompt=prompt)
    assert req.prompt == prompt
    assert completion_prompts(req) == prompts


def test_completion_defaults() -> None:
    req = completion()
    assert (req.max_tokens, req.n, req.stream, req.echo, req.logprobs, req.include_usage) == (
        16, 1, False, False, None, False)


def test_nulls_count_as_absent_and_unknown_fields_are_ignored() -> None:
    req = completion(n=None, temperature=None, stream=None, max_tokens=None, stop=None, whatever={"x": [1]},
                     prompt_logprobs=3, best_of=1, suffix="", logit_bias={})
    assert (req.n, req.temperature, req.stream, req.max_tokens, req.stop) == (1, 1.0, False, 16, None)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "extra": None}
    msg = chat(messages=[{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "user", "content": "x", "name": None}]).messages
    assert (msg[0].content, msg[1].name) == (None, None)


def test_chat_accepts_every_role_and_text_parts() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
        {"role": "assistant", "content": None},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]},
        {"role": "tool", "content": "t", "tool_call_id": "c1"},
    ]
    req = chat(messages=messages, tools=[], tool_choice="none", response_format={"type": "text"})
    assert chat_template_messages(req.messages) == [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "a\nb", "name": "u"},
        {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "", "tool_calls": [                  # arguments parsed, as templates read them
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}]},
        {"role": "tool", "content": "t", "tool_call_id": "c1"},
    ]


def test_stream_options_with_stream() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True, stream_options={}).include_usage
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_generate_tokenize_detokenize_decode() -> None:
    assert decode_generate(body(prompt="x")) == api.GenerateRequest(prompt="x", max_tokens=32)
    tok = decode_tokenize(body(messages=USER, add_special_tokens=False))
    assert (tok.prompt, tok.add_special_tokens, tok.add_generation_prompt) == (None, False, True)
    assert decode_tokenize(body(prompt="x")).prompt == "x"
    assert decode_detokenize(body(tokens=[1, 2])).tokens == [1, 2]


# ---- SamplingParams -------------------------------------------------------------------------------------


def test_completion_to_sampling_params() -> None:
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=-1,
                     presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, stop=["\n", ""],
                     stop_token_ids=[2], min_tokens=1, ignore_eos=True, logprobs=3, skip_special_tokens=False)
    assert to_sampling_params(req, default_max_tokens=100) == SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1, seed=-1, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, stop=("\n",), stop_token_ids=(2,), min_tokens=1,
        ignore_eos=True, logprobs=3, skip_special_tokens=False,
    )


def test_completion_defaults_to_default_sampling_params() -> None:
    assert to_sampling_params(completion(), default_max_tokens=100) == SamplingParams(max_tokens=16)
    params = to_sampling_params(completion(stop="END", temperature=0, seed=5), default_max_tokens=100)
    assert (params.stop, params.temperature, params.seed) == (("END",), 0.0, 5)
    assert isinstance(params.temperature, float)


def test_chat_max_tokens() -> None:
    assert to_sampling_params(chat(), default_max_tokens=100).max_tokens == 100
    assert to_sampling_params(chat(max_tokens=9), default_max_tokens=100).max_tokens == 9
    assert to_sampling_params(chat(max_completion_tokens=5, max_tokens=9), default_max_tokens=100).max_tokens == 5


def test_chat_logprobs() -> None:
    assert to_sampling_params(chat(), default_max_tokens=10).logprobs is None
    assert to_sampling_params(chat(logprobs=True), default_max_tokens=10).logprobs == 0
    assert to_sampling_params(chat(logprobs=True, top_logprobs=4), default_max_tokens=10).logprobs == 4
    assert to_sampling_params(chat(logprobs=False, top_logprobs=0), default_max_tokens=10).logprobs is None


def test_chat_to_sampling_params_extras() -> None:
    params = to_sampling_params(chat(top_k=40, min_p=0.05, stop_token_ids=[7, 8], ignore_eos=True, n=3),
                                default_max_tokens=10)
    assert (params.top_k, params.min_p, params.stop_token_ids, params.ignore_eos) == (40, 0.05, (7, 8), True)


def test_json_constraints_close_within_the_limit_and_others_do_not() -> None:
    """A JSON constraint's last tokens go to closing it (CLOSE_WITHIN, a quarter of max_tokens at most);
    a regex, choice or grammar has nothing to close, and an unconstrained request no grammar at all."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    named = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    cases = [(chat(max_tokens=200, response_format=named), CLOSE_WITHIN),
             (chat(max_tokens=40, response_format={"type": "json_object"}), 10),
             (completion(max_tokens=200, structured_outputs={"json": schema}), CLOSE_WITHIN),
             (completion(max_tokens=3, guided_json=schema), 0),
             (chat(max_tokens=200, tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]),
              CLOSE_WITHIN),
             (completion(max_tokens=200, guided_regex="[a-z]+"), 0),
             (completion(max_tokens=200, structured_outputs={"choice": ["a", "b"]}), 0),
             (completion(max_tokens=200), 0)]
    for req, within in cases:
        params = to_sampling_params(req, default_max_tokens=100, constraint=request_constraint(req))
        assert params.close_within == within, req


def test_generate_to_sampling_params() -> None:
    """/generate, the seed's endpoint: its max_tokens, greedy."""
    req, params = prepare_generate(body(prompt="x", max_tokens=4))
    assert req.prompt == "x" and params == SamplingParams(max_tokens=4, temperature=0.0)


# ---- responses ------------------------------------------------------------------------------------------

HEADER = ResponseHeader(request_id="cmpl-1", created=1700000000, model="m")
CHAT = ResponseHeader(request_id="chatcmpl-1", created=1700000000, model="m")
CHAT_USAGE = msgspec.structs.replace(CHAT, include_usage=True)


def roundtrip(obj: Any) -> Any:
    return json.loads(msgspec.json.encode(obj))


def test_completion_response_shape() -> None:
    choice = wire.completion_choice(0, " Paris.", "stop")
    out = wire.completion_response(HEADER, [choice], Usage(prompt_tokens=5, completion_tokens=3))
    assert roundtrip(out) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "system_fingerprint": None,
        "choices": [{"index": 0, "text": " Paris.", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
    }


def test_completion_chunks() -> None:
    assert wire.completion_chunk(HEADER, index=1, text=" Pa") == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "system_fingerprint": None,
        "choices": [{"index": 1, "text": " Pa", "logprobs": None, "finish_reason": None}],
    }
    with_usage = msgspec.structs.replace(HEADER, include_usage=True)
    last = wire.completion_chunk(with_usage, index=0, text="", finish_reason="length")
    assert last["usage"] is None and last["choices"][0]["finish_reason"] == "length"
    assert wire.completion_usage_chunk(with_usage, Usage(prompt_tokens=2, completion_tokens=1)) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1700000000, "model": "m",
        "system_fingerprint": None, "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3,
                  "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
    }


def test_chat_response_shape() -> None:
    out = wire.chat_response(CHAT, [wire.chat_choice(0, "Hi!", "stop")], Usage(prompt_tokens=9, completion_tokens=2))
    assert roundtrip(out) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!", "refusal": None, "tool_calls": []},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                  "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}},
    }


def test_chat_stream_chunks() -> None:
    envelope = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    assert wire.chat_role_chunk(CHAT, index=0) == {**envelope, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
    assert wire.chat_content_chunk(CHAT, index=0, content="Hi") == {**envelope, "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}]}
    assert wire.chat_finish_chunk(CHAT, index=0, finish_reason="stop") == {**envelope, "choices": [
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]}
    assert wire.chat_usage_chunk(CHAT_USAGE, Usage(prompt_tokens=9, completion_tokens=2)) == {
        **envelope, "choices": [], "usage": {
            "prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 0}}}


def test_chat_chunks_with_include_usage_carry_usage_null() -> None:
    chunks = [
        wire.chat_role_chunk(CHAT_USAGE, index=0),
        wire.chat_content_chunk(CHAT_USAGE, index=0, content="Hi"),
        wire.chat_finish_chunk(CHAT_USAGE, index=0, finish_reason="length"),
    ]
    for chunk in chunks:
        assert "usage" in chunk and chunk["usage"] is None
        assert b'"usage":null' in wire.sse_frame(chunk)
    assert "usage" not in wire.chat_role_chunk(CHAT, index=0)


TOKENS = [
    TokenLogprob(text="Hi", token_bytes=b"Hi", logprob=-0.01,
                 top=(("Hi", b"Hi", -0.01), ("Hey", b"Hey", -5.0), ("Hi", b"Hi", -7.0))),
    TokenLogprob(text="\ufffd", token_bytes=b"\xe2\x82", logprob=float("-inf"), top=()),
]


def test_completion_logprobs_shape() -> None:
    assert roundtrip(wire.completion_logprobs(TOKENS, [0, 2])) == {
        "tokens": ["Hi", "\ufffd"],
        "token_logprobs": [-0.01, -9999.0],
        "top_logprobs": [{"Hi": -0.01, "Hey": -5.0}, {}],
        "text_offset": [0, 2],
    }


def test_chat_logprobs_shape() -> None:
    assert roundtrip(wire.chat_logprobs(TOKENS)) == {"content": [
        {"token": "Hi", "logprob": -0.01, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.01, "bytes": [72, 105]},
            {"token": "Hey", "logprob": -5.0, "bytes": [72, 101, 121]},
            {"token": "Hi", "logprob": -7.0, "bytes": [72, 105]},
        ]},
        {"token": "\ufffd", "logprob": -9999.0, "bytes": [226, 130], "top_logprobs": []},
    ]}


def test_nan_logprob_is_json_number() -> None:
    entry = TokenLogprob(text="a", token_bytes=b"a", logprob=float("nan"))
    assert wire.chat_logprobs([entry])["content"][0]["logprob"] == -9999.0


def test_error_body_shape() -> None:
    assert wire.error_body("too long", "invalid_request_error", "messages", "context_length_exceeded") == {
        "error": {"message": "too long", "type": "invalid_request_error", "param": "messages",
                  "code": "context_length_exceeded"}}
    assert wire.error_body("x", "server_error") == {
        "error": {"message": "x", "type": "server_error", "param": None, "code": None}}


def test_model_list_shape() -> None:
    card = wire.model_card("m", created=0, max_model_len=4096)
    assert wire.model_list([card]) == {"object": "list", "data": [
        {"id": "m", "object": "model", "created": 0, "owned_by": "forge", "root": "m", "parent": None,
         "max_model_len": 4096}]}


def test_request_ids() -> None:
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", wire.new_request_id("cmpl"))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", wire.new_request_id("chatcmpl"))
    assert wire.new_request_id("cmpl") != wire.new_request_id("cmpl")


def test_sse_framing() -> None:
    assert wire.sse_frame({"a": [1, None]}) == b'data: {"a":[1,null]}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"
    assert SSE_PING == b": ping\n\n"


# ---- never anything but InvalidRequest ------------------------------------------------------------------

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "stop", "logprobs", "top_logprobs", "echo", "presence_penalty", "frequency_penalty",
    "seed", "user", "best_of", "suffix", "logit_bias", "response_format", "tools", "tool_choice", "top_k",
    "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
    "tokens", "add_special_tokens", "add_generation_prompt", "role", "content", "type", "text", "include_usage",
]
scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8) | st.sampled_from(["user", "text"])
)
json_ish = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=6),
    max_leaves=25,
)


def decodes_or_invalid(raw: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(raw)
        except InvalidRequest as exc:
            assert exc.message
            assert exc.param is None or isinstance(exc.param, str)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_invalid_request(raw: bytes) -> None:
    decodes_or_invalid(raw)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), json_ish, max_size=8))
def test_arbitrary_json_raises_only_invalid_request(obj: dict[str, Any]) -> None:
    decodes_or_invalid(json.dumps(obj).encode())


@settings(max_examples=100, deadline=None)
@given(json_ish)
def test_arbitrary_json_values_raise_only_invalid_request(obj: Any) -> None:
    decodes_or_invalid(json.dumps(obj).encode())


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), json_ish, max_size=8))
def test_decoded_requests_give_valid_sampling_params(obj: dict[str, Any]) -> None:
    raw = json.dumps({"prompt": "x", "messages": USER, **obj}).encode()
    for decode in (decode_completion, decode_chat):
        try:
            req = decode(raw)
        except InvalidRequest:
            continue
        to_sampling_params(req, default_max_tokens=64).validate(vocab_size=2**31)  # the edge admits only valid params


def test_reasoning_fields_give_a_thinking_budget() -> None:
    from forge.api.openai.openai_prepare import prepare_chat

    def budget(**fields: object) -> int | None:
        body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
        return prepare_chat(json.dumps(body).encode(), served_model_name="m", max_model_len=64).thinking_budget

    assert budget() is None and budget(reasoning_effort="low") == 512 and budget(reasoning_effort="high") == 8192
    assert budget(reasoning_effort="low", thinking_budget=7) == 7 and budget(thinking_budget=0) == 0
    assert budget(reasoning_effort="none") == 0 and budget(reasoning_effort="minimal") == 128
    assert budget(reasoning_effort="max") is None           # OpenAI's highest level: unbounded
    for field, value in (("thinking_budget", -1), ("thinking_budget", 1.5), ("reasoning_effort", "extreme")):
        with pytest.raises(InvalidRequest) as refused:
            budget(**{field: value})
        assert refused.value.param == field
