"""Eval-grade completions through the real server: lm-evaluation-harness's loglikelihood request (echo with
logprobs: the prompt's tokens scored, the first null), scoring without generating (max_tokens 0), the
echo streamed, vLLM's prompt_logprobs on completions and chat, and a scored request beside others."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import openai

from actors.supervisor import running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    completion_text,
    data_payloads,
)

CONTEXT = "Question: What is the capital of France?\nAnswer:"
# A position computed in a prompt's prefill and by a decode step, with a float32 K/V cache: a few 1e-6 apart
# (tests/unit/test_prompt_logprobs.py; the default float16 cache, up to a few 1e-4).
DECODE_TOLERANCE = 2e-5


def http(url: str) -> httpx.AsyncClient:
    """A client that waits as long as the test may (httpx's default 5 s is short for 2 busy cores)."""
    return httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S)


async def tokenize(client: httpx.AsyncClient, text: str) -> list[int]:
    resp = await client.post("/tokenize", json={"prompt": text})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["tokens"])


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json={"model": SERVED_MODEL, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


async def streamed(client: httpx.AsyncClient, **body: Any) -> list[Any]:
    request = {"model": SERVED_MODEL, "temperature": 0, "stream": True, **body}
    async with client.stream("POST", "/v1/completions", json=request) as resp:
        assert resp.status_code == 200
        raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    return data_payloads(raw)


def lm_eval_loglikelihood(choice: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions makes of a choice (LocalCompletionsAPI.parse_logprobs):
    the continuation's logprobs summed, the last (generated) token left out, and whether each was the top."""
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True))


def check_echoed(choice: dict[str, Any], prompt_ids: list[int], num_generated: int) -> None:
    lp = choice["logprobs"]
    n = len(prompt_ids) + num_generated
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert "".join(lp["tokens"]) == choice["text"]


async def test_the_lm_eval_loglikelihood_request(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, http(url) as client:
            context = await tokenize(client, CONTEXT)
            good, bad = await tokenize(client, " Paris"), await tokenize(client, " Banana")
            body = await complete(client, prompt=[context + good, context + bad], max_tokens=1, logprobs=1,
                                  echo=True, seed=1234)
            text = (await complete(client, prompt=CONTEXT + " Paris", max_tokens=1, logprobs=1, echo=True))
    paris, banana = sorted(body["choices"], key=lambda c: c["index"])
    check_echoed(paris, context + good, 1)
    check_echoed(banana, context + bad, 1)
    assert paris["text"].startswith(CONTEXT + " Paris") and paris["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["prompt_tokens"] == len(context + good) + len(context + bad)
    (good_ll, good_greedy), (bad_ll, bad_greedy) = (lm_eval_loglikelihood(c, len(context)) for c in (paris, banana))
    assert bad_ll < good_ll < 0 and not bad_greedy                   # no longer silently 0
    assert text["choices"][0]["logprobs"]["token_logprobs"] == paris["logprobs"]["token_logprobs"]
    assert good_greedy == (paris["logprobs"]["tokens"][len(context)] == max(
        paris["logprobs"]["top_logprobs"][len(context)], key=paris["logprobs"]["top_logprobs"][len(context)].get))


async def test_a_continuation_scores_as_it_was_generated(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon(enable_prefix_caching=False, kv_cache_dtype="float32")) as url, \
                http(url) as client:
            prompt = await tokenize(client, PROMPT)
            made = (await complete(client, prompt=[prompt], max_tokens=8, logprobs=3, ignore_eos=True))["choices"][0]
            generated = await tokenize(client, PROMPT + made["text"])
            assert generated[:len(prompt)] == prompt
            scored = (await complete(client, prompt=[generated], max_tokens=0, logprobs=3, echo=True))["choices"][0]
    check_echoed(scored, generated, 0)
    assert scored["finish_reason"] == "length" and scored["text"] == PROMPT + made["text"]
    continuation = scored["logprobs"]
    assert continuation["tokens"][len(prompt):] == made["logprobs"]["tokens"]    # the text re-tokenizes alike
    for i, logprob in enumerate(made["logprobs"]["token_logprobs"]):
        assert abs(continuation["token_logprobs"][len(prompt) + i] - logprob) < DECODE_TOLERANCE, i


async def test_max_tokens_zero_scores_without_generating(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, http(url) as client:
            ids = await tokenize(client, CONTEXT)
            body = await complete(client, prompt=CONTEXT, max_tokens=0, echo=True, logprobs=2)
            chunks = await streamed(client, prompt=CONTEXT, max_tokens=0, echo=True, logprobs=2,
                                    stream_options={"include_usage": True})
            text_only = await complete(client, prompt=CONTEXT, max_tokens=0, echo=True)
            refused = await client.post("/v1/completions", json={"prompt": CONTEXT, "max_tokens": 0})
    [choice] = body["choices"]
    check_echoed(choice, ids, 0)
    assert choice["text"] == CONTEXT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    [one, usage] = chunks                                           # the whole answer in one chunk, then usage
    assert one["choices"][0] == choice and usage["usage"]["completion_tokens"] == 0
    assert text_only["choices"][0]["text"] == CONTEXT and text_only["choices"][0]["logprobs"] is None
    assert_error(refused, 400, param="max_tokens")


async def test_an_echo_with_logprobs_streams_as_it_answers(make_daemon: MakeDaemon) -> None:
    request = {"prompt": [CONTEXT, PROMPT], "max_tokens": 6, "echo": True, "logprobs": 1, "n": 2}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, http(url) as client:
            whole = await complete(client, **request)
            chunks = await streamed(client, **request)
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        joined: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in chunks:
            for part in chunk["choices"]:
                if part["index"] == choice["index"] and part["logprobs"] is not None:
                    for key, values in joined.items():
                        values.extend(part["logprobs"][key])
        assert completion_text(chunks, choice["index"]) == choice["text"]
        assert joined == choice["logprobs"]
        first = next(c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"])
        assert first["text"].startswith(CONTEXT if choice["index"] < 2 else PROMPT)   # the echo comes first


async def test_vllm_prompt_logprobs_on_completions_and_chat(make_daemon: MakeDaemon) -> None:
    chat = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3,
            "temperature": 0, "prompt_logprobs": 2}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, http(url) as client:
            ids = await tokenize(client, PROMPT)
            body = await complete(client, prompt=PROMPT, max_tokens=2, prompt_logprobs=3)
            plain = await complete(client, prompt=PROMPT, max_tokens=2)
            answer = (await client.post("/v1/chat/completions", json=chat)).json()
            plain_chat = (await client.post("/v1/chat/completions", json={**chat, "prompt_logprobs": None})).json()
            refused = [await client.post(route, json={**chat, "prompt": PROMPT, "stream": True})
                       for route in ("/v1/completions", "/v1/chat/completions")]
    [choice] = body["choices"]
    scored = choice["prompt_logprobs"]
    assert choice["logprobs"] is None and "prompt_logprobs" not in plain["choices"][0]
    assert choice["text"] == plain["choices"][0]["text"]             # the answer is the same
    assert len(scored) == len(ids) and scored[0] is None
    for token_id, entry in zip(ids[1:], scored[1:], strict=True):
        assert list(entry)[0] == str(token_id)                         # the prompt's token first
        assert 3 <= len(entry) <= 4
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token_id))
        assert ranks[:3] == [1, 2, 3] or entry[str(token_id)]["rank"] <= 3
        assert all(isinstance(v["logprob"], float) and isinstance(v["decoded_token"], str) for v in entry.values())
    prompt_logprobs = answer["prompt_logprobs"]                        # beside the choices, as vLLM's
    assert "prompt_logprobs" not in answer["choices"][0] and "prompt_logprobs" not in plain_chat
    assert len(prompt_logprobs) == answer["usage"]["prompt_tokens"] and prompt_logprobs[0] is None
    assert answer["choices"][0]["message"]["content"] == plain_chat["choices"][0]["message"]["content"]
    for resp in refused:
        assert_error(resp, 400, param="prompt_logprobs")


async def test_a_scored_request_leaves_the_others_untouched(make_daemon: MakeDaemon) -> None:
    generate = {"prompt": PROMPT, "max_tokens": 12, "logprobs": 2, "ignore_eos": True}
    score = {"prompt": CONTEXT * 8, "max_tokens": 0, "echo": True, "logprobs": 5}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon(enable_prefix_caching=False)) as url, \
                http(url) as client:
            alone = await complete(client, **generate)
            results: dict[str, dict[str, Any]] = {}

            async def run(name: str, body: dict[str, Any]) -> None:
                results[name] = await complete(client, **body)

            async with anyio.create_task_group() as tg:
                tg.start_soon(run, "scored", score)
                tg.start_soon(run, "beside", generate)
    beside = results["beside"]["choices"][0]
    assert beside["text"] == alone["choices"][0]["text"]
    assert beside["logprobs"] == alone["choices"][0]["logprobs"]
    assert results["scored"]["choices"][0]["logprobs"]["token_logprobs"][0] is None


async def test_the_openai_client_reads_an_echoed_score(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, \
                openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S) as client:
            out = await client.completions.create(model=SERVED_MODEL, prompt=CONTEXT, max_tokens=0, echo=True,
                                                  logprobs=1, extra_body={"prompt_logprobs": 1})
            stream = await client.completions.create(model=SERVED_MODEL, prompt=CONTEXT, max_tokens=2, echo=True,
                                                     logprobs=1, temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
    [choice] = out.choices
    lp = choice.logprobs
    assert choice.text == CONTEXT and choice.finish_reason == "length" and lp is not None
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None and all(len(top) == 1 for top in lp.top_logprobs[1:])
    scored = (choice.model_extra or {})["prompt_logprobs"]                 # vLLM's, beside the echo's: the same
    assert len(scored) == len(lp.tokens) and scored[0] is None
    assert [next(iter(e.values()))["logprob"] for e in scored[1:]] == lp.token_logprobs[1:]
    assert chunks[0].choices[0].text.startswith(CONTEXT)
