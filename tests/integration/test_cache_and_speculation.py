"""The prefix cache and speculative decoding as users and operators see them: cached_tokens in every
usage, cache_salt isolation, the prefix-cache and speculation counters, and a speculating daemon that
answers exactly as a plain one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, MakeDaemon, scraped

SYSTEM = ("You are a careful assistant for the harbour museum of Gull Rock. " * 12).strip()   # ~160 tokens
TEXT = ("The lighthouse on Gull Rock was built in 1871 by the harbour board. Its lamp burned paraffin until "
        "1934, when an electric lamp replaced it. The keeper, Thomas Reed, kept a log of every ship that "
        "passed, and his daughter Mary rowed out to rescue the crew of the schooner Alba in the storm of 1889.")


metric = scraped


async def sse_usage(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    async with http.stream("POST", path, json={**body, "stream": True,
                                               "stream_options": {"include_usage": True}}) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                usage = httpx.Response(200, content=line[6:]).json()["usage"]
    return usage


async def test_cached_tokens_in_every_usage_and_salts_keep_tenants_apart(make_daemon: MakeDaemon) -> None:
    chat = {"model": SERVED_MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]}
    completion = {"model": SERVED_MODEL, "max_tokens": 2, "temperature": 0, "prompt": SYSTEM + " Hello?"}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            first = (await http.post("/v1/chat/completions", json=chat)).json()["usage"]
            again = (await http.post("/v1/chat/completions", json=chat)).json()["usage"]
            streamed = await sse_usage(http, "/v1/chat/completions", chat)
            plain_completion = (await http.post("/v1/completions", json=completion)).json()["usage"]
            completion_again = (await http.post("/v1/completions", json=completion)).json()["usage"]
            streamed_completion = await sse_usage(http, "/v1/completions", completion)
            salted = (await http.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant-a"})).json()["usage"]
            salted_again = (await http.post("/v1/chat/completions",
                                            json={**chat, "cache_salt": "tenant-a"})).json()["usage"]
            other_salt = (await http.post("/v1/chat/completions",
                                          json={**chat, "cache_salt": "tenant-b"})).json()["usage"]
            text = (await http.get("/metrics")).text
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    prompt = first["prompt_tokens"]
    for usage in (again, streamed):
        assert usage["prompt_tokens"] == prompt and usage["prompt_tokens_details"]["cached_tokens"] >= prompt - 16
    assert plain_completion["prompt_tokens_details"]["cached_tokens"] == 0
    for usage in (completion_again, streamed_completion):
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16 > 0
    # A salt never finds another salt's blocks (nor the unsalted ones), but finds its own.
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0
    assert other_salt["prompt_tokens_details"]["cached_tokens"] == 0
    assert salted_again["prompt_tokens_details"]["cached_tokens"] >= prompt - 16
    # The counters add up: every token looked up was found or missed for a reason.
    queries, hits = metric(text, "forge:prefix_cache_queries_total"), metric(text, "forge:prefix_cache_hits_total")
    misses = {r: metric(text, "forge:prefix_cache_misses_total", reason=r)
              for r in ("partial_block", "evicted", "new")}
    assert queries > hits > 0 and misses["new"] > 0 and misses["partial_block"] > 0
    assert queries == hits + sum(misses.values())


async def test_a_speculating_daemon_answers_as_a_plain_one(make_daemon: MakeDaemon, default_model_path: Path) -> None:
    """Plain, n-gram guesses, and a draft model's (the model itself: `--draft-model` loads a second
    copy, with K/V of its own in the same blocks)."""
    body = {"model": SERVED_MODEL, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "user", "content": f"{TEXT}\n\nQuote, word for word, the sentence about Mary."}]}
    answers: dict[str, dict[str, Any]] = {}
    drafts: dict[str, dict[str, Any]] = {"off": {}, "ngram": {}, "draft": {"draft_model": str(default_model_path)}}
    with anyio.fail_after(3 * HANG_GUARD_S):
        for spec, draft in drafts.items():
            async with running_daemon(make_daemon(speculative=spec, **draft)) as url, \
                    httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                answers[spec] = (await http.post("/v1/chat/completions", json=body)).json()
                async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
                    answers[spec + "-stream"] = {"text": "".join(
                        httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"].get("content") or ""
                        for line in [line async for line in reply.aiter_lines()]
                        if line.startswith("data: {"))}
                answers[spec + "-metrics"] = {"text": (await http.get("/metrics")).text}
    plain, spec = answers["off"], answers["ngram"]
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert answers["ngram-stream"]["text"] == plain["choices"][0]["message"]["content"]
    details = spec["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] >= 0
    assert "accepted_prediction_tokens" not in plain["usage"]["completion_tokens_details"]
    text = answers["ngram-metrics"]["text"]
    drafts = metric(text, "forge:spec_decode_num_drafts_total")
    proposed = metric(text, "forge:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "forge:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= proposed and drafts > 0
    assert metric(text, "forge:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
    assert metric(answers["off-metrics"]["text"], "forge:spec_decode_num_drafts_total") == 0
    drafted = answers["draft"]
    assert drafted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert answers["draft-stream"]["text"] == plain["choices"][0]["message"]["content"]
    details = drafted["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 2 * details["rejected_prediction_tokens"]
