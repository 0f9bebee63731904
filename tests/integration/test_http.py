"""The HTTP surface through the real server with httpx: SSE framing, plain routes, metrics, errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from actors.supervisor import running_daemon
from forge.kernels import choose_kernels
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    completion_text,
    data_payloads,
    long_prompt,
    sample,
    scraped,
    sse_events,
)

CHAT = [{"role": "user", "content": "Say hi."}]


async def test_sse_framing_and_headers(make_daemon: MakeDaemon) -> None:
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                raw = b"".join([chunk async for chunk in resp.aiter_raw()])
            chat = {"model": SERVED_MODEL, "messages": CHAT, "max_tokens": 4, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=chat) as chat_resp:
                chat_raw = b"".join([chunk async for chunk in chat_resp.aiter_raw()])
    for r in (resp, chat_resp):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-accel-buffering"] == "no"
        assert r.headers["x-request-id"]
    assert raw.endswith(b"\n\ndata: [DONE]\n\n") and chat_raw.endswith(b"\n\ndata: [DONE]\n\n")
    assert all(e.startswith(b"data: ") for e in sse_events(raw))        # no `event:` names, no pings
    payloads = data_payloads(raw)
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)
    assert "Paris" in completion_text(payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    chat_payloads = data_payloads(chat_raw)
    assert chat_payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat_payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_streamed_completion_logprobs_are_well_formed(make_daemon: MakeDaemon) -> None:
    # The stop string is never matched, but " Paris" is its prefix: that text is held back for a
    # step, and its logprobs must still reach the stream.
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "stop": [" Paris is the"]}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url) as client:
            plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    tokens, offsets, top = [], [], []
    for payload in data_payloads(raw):
        [choice] = payload["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        tokens += lp["tokens"]
        offsets += lp["text_offset"]
        top += lp["top_logprobs"]
    assert plain["text"].startswith(" Paris") and "".join(tokens) == completion_text(data_payloads(raw))
    assert tokens == plain["logprobs"]["tokens"] and offsets == plain["logprobs"]["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert all(1 <= len(t) <= 2 for t in top)


async def test_plain_routes(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url) as client:
            health = await client.get("/healthz")
            generated = await client.post("/generate", json={"prompt": PROMPT, "max_tokens": 4})
            tokenized = await client.post("/tokenize", json={"prompt": "Hello, world! 123"})
            detokenized = await client.post("/detokenize", json={"tokens": tokenized.json()["tokens"]})
            chat_tokens = await client.post("/tokenize", json={"messages": CHAT})
            models = await client.get("/v1/models")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert generated.status_code == 200
    out = generated.json()
    assert set(out) == {"text", "prompt_tokens", "completion_tokens"}
    assert "Paris" in out["text"] and out["prompt_tokens"] == 5 and out["completion_tokens"] == 4
    ids = tokenized.json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 1024
    assert detokenized.status_code == 200 and detokenized.json() == {"prompt": "Hello, world! 123"}
    assert chat_tokens.json()["count"] > ids["count"]                      # the template adds turns
    card = models.json()
    assert card["object"] == "list" and [m["id"] for m in card["data"]] == [SERVED_MODEL]
    assert card["data"][0]["max_model_len"] == 1024


METRIC_NAMES = ["forge:num_requests_running", "forge:num_requests_waiting", "forge:kv_cache_usage_perc",
                "forge:prompt_tokens_total", "forge:generation_tokens_total", "forge:request_success_total",
                "forge:time_to_first_token_seconds_bucket", "forge:inter_token_latency_seconds_bucket",
                "forge:e2e_request_latency_seconds_bucket", "forge:request_queue_time_seconds_bucket",
                "forge:num_preemptions_total", "forge:prefix_cache_hit_rate",
                "forge:iteration_tokens_total_bucket", "forge:step_duration_seconds_bucket"]


async def test_metrics_grow_after_a_request(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url) as client:
            before = await client.get("/metrics")
            done = await client.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": PROMPT,
                                                               "max_tokens": 3, "ignore_eos": True})
            after = await client.get("/metrics")
    assert done.status_code == 200
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    for name in METRIC_NAMES:
        assert f"\n{name}" in after.text, name

    def before_(name: str, **labels: str) -> float:        # every series of the model names it
        return scraped(before.text, name, model_name=SERVED_MODEL, **labels)

    def after_(name: str, **labels: str) -> float:
        return scraped(after.text, name, model_name=SERVED_MODEL, **labels)

    assert before_("forge:prompt_tokens_total") == 0 and after_("forge:prompt_tokens_total") == 5
    assert before_("forge:generation_tokens_total") == 0 and after_("forge:generation_tokens_total") == 3
    assert after_("forge:request_success_total", finished_reason="length") == 1
    ttft = "forge:time_to_first_token_seconds_count"
    assert after_(ttft) == 1 + before_(ttft)
    assert after_("forge:e2e_request_latency_seconds_count") == 1
    assert after_("forge:num_requests_running") == 0 and after_("forge:kv_cache_usage_perc") == 0
    default = choose_kernels("auto").name                                           # what auto picks here
    assert after_("forge:kernels_info", backend=default, numerics="reference", attention="compiled") == 1
    # 3 tokens: one step computes the prompt and samples the first, two decode steps the others
    steps = after_("forge:iteration_tokens_total_count") - before_("forge:iteration_tokens_total_count")
    assert steps == 3 == after_("forge:step_duration_seconds_count") - before_("forge:step_duration_seconds_count")
    assert after_("forge:iteration_tokens_total_sum") - before_("forge:iteration_tokens_total_sum") == 5 + 2
    assert scraped(after.text, "forge:prompt_tokens_total", model_name="another") == 0


# (method, path, body (bytes, or JSON), status, param, code): every bad input and its error.
BAD_INPUTS: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("POST", "/v1/completions", b'{"prompt": "hi", ', 400, None, None),
    ("POST", "/v1/completions", b"", 400, None, None),
    ("POST", "/v1/completions", b'["a list"]', 400, None, None),
    ("POST", "/v1/chat/completions", b"{not json}", 400, None, None),
    ("POST", "/v1/completions", b'{"prompt": "caf\xe9 \xff"}', 400, None, None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": 42}, 400, "prompt", None),
    ("POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
    ("POST", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role", None),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": 5}, 400, "temperature", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1, "stream": True}, 400, "max_tokens", None),
    ("POST", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ("POST", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n", None),
    ("POST", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", None),
    ("POST", "/v1/completions", {"prompt": [99999999]}, 400, None, None),
    ("POST", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 30, "logprobs": True}, 400,
     "top_logprobs", None),
    ("POST", "/detokenize", {"tokens": [10**9]}, 400, "tokens", None),
    ("POST", "/generate", {"prompt": ["not", "a", "string"]}, 400, "prompt", None),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": CHAT, "stream": True}, 404, "model",
     "model_not_found"),
    ("GET", "/no/such/route", None, 404, None, None),
    ("GET", "/v1/completions", None, 405, None, None),
    ("POST", "/v1/completions", {"prompt": long_prompt(600), "max_tokens": 4}, 400, "prompt",
     "context_length_exceeded"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt(600)}],
                                      "stream": True}, 400, None, "context_length_exceeded"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param", "code"), BAD_INPUTS,
                         ids=[f"{i}-{c[1]}-{c[3]}" for i, c in enumerate(BAD_INPUTS)])
async def test_bad_input_gets_an_openai_error(make_daemon: MakeDaemon, method: str, path: str, body: Any,
                                              status: int, param: str | None, code: str | None) -> None:
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url) as client:
            resp = await client.request(method, path, content=content,
                                        headers={"content-type": "application/json"})
            health = await client.get("/healthz")
    assert_error(resp, status, param=param, code=code)
    assert health.status_code == 200                       # and the daemon is still fine


async def test_body_over_the_limit_gets_413(make_daemon: MakeDaemon) -> None:
    big = json.dumps({"prompt": "x" * 10_000}).encode()

    async def chunked() -> AsyncIterator[bytes]:           # no Content-Length: counted as it streams
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    with anyio.fail_after(HANG_GUARD_S):
        daemon = make_daemon(gateway={"max_body_size": 4096})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url) as client:
            declared = await client.post("/v1/completions", content=big)
            streamed = await client.post("/v1/completions", content=chunked())
            fits = await client.post("/tokenize", json={"prompt": "x" * 1000})
    assert_error(declared, 413, code="body_too_large")
    assert_error(streamed, 413, code="body_too_large")
    assert fits.status_code == 200


async def test_api_key(make_daemon: MakeDaemon) -> None:
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2}
    with anyio.fail_after(HANG_GUARD_S):
        daemon = make_daemon(gateway={"api_key": "sekret"})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url) as client:
            missing = await client.post("/v1/completions", json=body)
            wrong = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer nope"})
            not_bearer = await client.get("/v1/models", headers={"authorization": "sekret"})
            metrics = await client.get("/metrics")
            health = await client.get("/healthz")
            good = await client.post("/v1/completions", json=body, headers={"authorization": "Bearer sekret"})
            models = await client.get("/v1/models", headers={"authorization": "bearer sekret"})
    for resp in (missing, wrong, not_bearer, metrics):
        assert_error(resp, 401, type="authentication_error")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert good.status_code == 200 and models.status_code == 200


async def test_ping_comment_while_a_long_prefill_runs(make_daemon: MakeDaemon) -> None:
    # ~600 prompt tokens in chunks of 32: the prefill spans many steps with nothing to send.
    daemon = make_daemon(max_num_batched_tokens=32, gateway={"sse_ping_interval": 0.05})
    body = {"model": SERVED_MODEL, "prompt": long_prompt(300), "max_tokens": 2, "stream": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url) as client:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                raw = b"".join([chunk async for chunk in resp.aiter_raw()])
    events = sse_events(raw)
    assert b": ping" in events
    assert events.index(b": ping") < next(i for i, e in enumerate(events) if e.startswith(b"data: "))
    assert set(events) <= {b": ping"} | {e for e in events if e.startswith(b"data: ")}
    payloads = data_payloads(raw)
    assert payloads and payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert sample(daemon, "forge:prompt_tokens_total") > 4 * 32
