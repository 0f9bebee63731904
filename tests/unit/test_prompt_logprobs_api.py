"""The wire side of prompt logprobs: which requests ask for them (echo with logprobs, vLLM's prompt_logprobs,
max_tokens 0 with echo), what the schema refuses, and the shapes they are written in (the legacy logprobs
object with the prompt's first token null, vLLM's prompt_logprobs list)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from forge.api.openai import openai_output as wire
from forge.api.openai.openai_output import TokenLogprob
from forge.api.openai.openai_prepare import prepare_chat, prepare_completion
from forge.errors import InvalidRequest
from forge.sampling.sampling_params import SamplingParams


def completion(**fields: Any) -> SamplingParams:
    return prepare_completion(json.dumps({"prompt": [[1, 2, 3]], **fields}).encode(), served_model_name="m").params


def chat(**fields: Any) -> SamplingParams:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return prepare_chat(json.dumps(body).encode(), served_model_name="m", max_model_len=64).params


# The lm-evaluation-harness local-completions loglikelihood request, as it sends it.
LM_EVAL = {"prompt": [[1, 2, 3]], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}


@pytest.mark.parametrize(("fields", "prompt_logprobs"), [
    ({}, None),
    ({"logprobs": 2}, None),                                       # generated tokens only
    ({"echo": True}, None),                                        # the text only
    ({"echo": True, "logprobs": 0}, 0),
    ({"echo": True, "logprobs": 3}, 3),
    ({"prompt_logprobs": 4}, 4),                                   # vLLM's
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 5}, 5),      # scored once, with the more alternatives
    ({"echo": True, "logprobs": 5, "prompt_logprobs": 2}, 5),
    ({"echo": True, "logprobs": 2, "stream": True}, 2),            # an echo streams its logprobs
    ({"prompt_logprobs": 0, "stream": True}, None),                # vLLM's are left out of a stream
])
def test_which_completions_score_their_prompt(fields: dict[str, Any], prompt_logprobs: int | None) -> None:
    assert completion(**fields).prompt_logprobs == prompt_logprobs


def test_the_lm_eval_request_scores_its_prompt_and_one_token() -> None:
    params = prepare_completion(json.dumps(LM_EVAL).encode(), served_model_name="m").params
    assert params.prompt_logprobs == 1 and params.logprobs == 1 and params.max_tokens == 1 and params.is_greedy


def test_max_tokens_zero_scores_only_with_echo() -> None:
    assert completion(echo=True, max_tokens=0, logprobs=1).max_tokens == 0
    completion(echo=True, max_tokens=0, logprobs=1).validate(vocab_size=10)
    with pytest.raises(InvalidRequest, match="0 only with echo") as info:
        completion(max_tokens=0)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as negative:
        completion(echo=True, max_tokens=-1)
    assert negative.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as chat_zero:
        chat(max_tokens=0)                                         # chat always generates
    assert chat_zero.value.param == "max_tokens"


@pytest.mark.parametrize("value", [-1, 21, 2.5, "3", True])
def test_prompt_logprobs_out_of_range_or_type(value: Any) -> None:
    for make in (completion, chat):
        with pytest.raises(InvalidRequest) as info:
            make(prompt_logprobs=value)
        assert info.value.param == "prompt_logprobs"


def test_prompt_logprobs_are_not_streamed() -> None:
    for make in (completion, chat):
        with pytest.raises(InvalidRequest, match="not available when stream") as info:
            make(prompt_logprobs=1, stream=True)
        assert info.value.param == "prompt_logprobs"
    assert chat(prompt_logprobs=3).prompt_logprobs == 3
    assert chat(prompt_logprobs=0, stream=True).prompt_logprobs is None


def entry(text: str, logprob: float | None, token_id: int, rank: int | None = None,
          top: tuple[tuple[int, str, float], ...] = ()) -> TokenLogprob:
    return TokenLogprob(text=text, token_bytes=text.encode(), logprob=logprob, token_id=token_id, rank=rank,
                        top=tuple((t, t.encode(), lp) for _, t, lp in top), top_ids=tuple(i for i, _, _ in top))


PROMPT = [entry("The", None, 504),
          entry(" cat", -3.5, 2368, rank=12, top=((253, " first", -1.25), (1385, " best", -2.0))),
          entry(" sat", -0.5, 8208, rank=1, top=((8208, " sat", -0.5), (5, " was", -float("inf"))))]


def test_vllm_prompt_logprobs_shape() -> None:
    assert wire.prompt_logprobs(PROMPT, 2) == [
        None,
        {"2368": {"logprob": -3.5, "rank": 12, "decoded_token": " cat"},
         "253": {"logprob": -1.25, "rank": 1, "decoded_token": " first"},
         "1385": {"logprob": -2.0, "rank": 2, "decoded_token": " best"}},
        {"8208": {"logprob": -0.5, "rank": 1, "decoded_token": " sat"},      # the token, among the top: once
         "5": {"logprob": -9999.0, "rank": 2, "decoded_token": " was"}},
    ]
    assert list(wire.prompt_logprobs(PROMPT, 2)[2] or {}) == ["8208", "5"]
    assert wire.prompt_logprobs(PROMPT, 0)[1] == {"2368": {"logprob": -3.5, "rank": 12, "decoded_token": " cat"}}


def test_echoed_logprobs_start_with_a_null() -> None:
    generated = TokenLogprob(text=" on", token_bytes=b" on", logprob=-0.25, top=((" on", b" on", -0.25),))
    body = wire.completion_logprobs([*PROMPT, generated], [0, 3, 7, 11])
    assert body == {"tokens": ["The", " cat", " sat", " on"], "token_logprobs": [None, -3.5, -0.5, -0.25],
                    "top_logprobs": [None, {" first": -1.25, " best": -2.0}, {" sat": -0.5, " was": -9999.0},
                                     {" on": -0.25}],
                    "text_offset": [0, 3, 7, 11]}
    assert json.loads(json.dumps(body)) == body
    # lm-evaluation-harness sums token_logprobs[ctxlen:-1] and calls a token greedy when it is its top's best
    assert sum(body["token_logprobs"][1:-1]) == -4.0
    assert body["token_logprobs"][2] == max(body["top_logprobs"][2].values())


def test_prompt_logprobs_only_where_asked() -> None:
    assert "prompt_logprobs" not in wire.completion_choice(0, "x", "stop")
    assert wire.completion_choice(0, "x", "length", None, [None])["prompt_logprobs"] == [None]
    header = wire.ResponseHeader(request_id="chatcmpl-1", created=0, model="m")
    usage = wire.Usage(prompt_tokens=1, completion_tokens=1)
    assert "prompt_logprobs" not in wire.chat_response(header, [], usage)
    assert wire.chat_response(header, [], usage, [None])["prompt_logprobs"] == [None]
