"""The official openai client against the real server: completions and chat, streamed and not."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, PROMPT, SERVED_MODEL, MakeDaemon

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]


@asynccontextmanager
async def serving(make_daemon: MakeDaemon, **engine: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    async with running_daemon(make_daemon(**engine)) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                      timeout=HANG_GUARD_S) as client:
            yield client


async def test_greedy_completion_knows_paris_streamed_or_not(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            plain = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4,
                                                    temperature=0)
            stream = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4,
                                                     temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
    [choice] = plain.choices
    assert "Paris" in choice.text
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert plain.object == "text_completion" and plain.model == SERVED_MODEL
    assert plain.usage is not None and plain.usage.prompt_tokens == 5
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == choice.text      # greedy: the same text
    assert [c.choices[0].finish_reason for c in chunks][-1] == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


async def test_chat_streamed_and_not(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            plain = await client.chat.completions.create(model=SERVED_MODEL, messages=CHAT,
                                                         max_completion_tokens=6, temperature=0)
            stream = await client.chat.completions.create(model=SERVED_MODEL, messages=CHAT,
                                                          max_completion_tokens=6, temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
    [choice] = plain.choices
    assert plain.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)                            # no include_usage


async def test_completion_logprobs(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            out = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4,
                                                  temperature=0, logprobs=2)
    [choice] = out.choices
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert out.usage is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == out.usage.completion_tokens
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert math.isfinite(logprob) and logprob <= 0.0
        assert 1 <= len(top) <= 2 and all(v <= 0.0 for v in top.values())
        assert token in top                                   # greedy: the pick is the best one
        assert top[token] == pytest.approx(logprob, abs=1e-4) and logprob >= max(top.values()) - 1e-4


async def test_chat_logprobs(make_daemon: MakeDaemon) -> None:
    # The second request must compute what the first did, so that its logprobs can be held to the
    # first's: with the prefix cache on it would reuse the first's blocks and compute only the last
    # prompt token afresh, whose K/V (a rounding of float32 results that differ from the batched
    # ones by ~1e-7) can land one float16 step apart, which moves a logprob by up to ~1e-3.
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon, enable_prefix_caching=False) as client:
            out = await client.chat.completions.create(model=SERVED_MODEL, messages=CHAT,
                                                       max_completion_tokens=4, temperature=0,
                                                       logprobs=True, top_logprobs=2)
            stream = await client.chat.completions.create(model=SERVED_MODEL, messages=CHAT,
                                                          max_completion_tokens=4, temperature=0,
                                                          logprobs=True, top_logprobs=2, stream=True)
            chunks = [chunk async for chunk in stream]
    [choice] = out.choices
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert out.usage is not None and len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == choice.message.content
    for entry in content:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token                   # greedy: the best one
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


async def test_two_choices(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            out = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4,
                                                  temperature=1, seed=3, n=2)
            stream = await client.chat.completions.create(model=SERVED_MODEL, messages=CHAT,
                                                          max_completion_tokens=4, n=2, stream=True)
            chunks = [chunk async for chunk in stream]
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert out.usage is not None and out.usage.prompt_tokens == 5      # the prompt counts once
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason is not None}
    assert set(finishes) == {0, 1}
    assert {c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"} == {0, 1}


async def test_stop_string_ends_with_stop(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            # Greedy continues " Paris.\n\nThe answer..."; the stop string "." ends it after " Paris".
            plain = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=8,
                                                    temperature=0, stop=["."])
            stream = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=8,
                                                     temperature=0, stop=["."], stream=True)
            chunks = [chunk async for chunk in stream]
    [choice] = plain.choices
    assert choice.finish_reason == "stop"
    assert "Paris" in choice.text and "." not in choice.text
    text = "".join(c.choices[0].text for c in chunks)
    assert text == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_include_usage_ends_with_a_usage_chunk(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            stream = await client.completions.create(model=SERVED_MODEL, prompt=PROMPT, max_tokens=4,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            chat = await client.chat.completions.create(model=SERVED_MODEL, messages=CHAT,
                                                        max_completion_tokens=4, stream=True,
                                                        stream_options={"include_usage": True})
            chat_chunks = [chunk async for chunk in chat]
    for all_chunks in (chunks, chat_chunks):
        *body, last = all_chunks
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == 4 or body[-1].choices[0].finish_reason == "stop"
        assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
        assert all(c.usage is None and c.choices for c in body)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 5


async def test_seed_reproduces_sampling(make_daemon: MakeDaemon) -> None:
    async def sample(client: openai.AsyncOpenAI, seed: int) -> str:
        out = await client.completions.create(model=SERVED_MODEL, prompt="Once upon a time", max_tokens=8,
                                              temperature=1, seed=seed)
        return out.choices[0].text

    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            first, again = await sample(client, 1234), await sample(client, 1234)
            others = [await sample(client, seed) for seed in (1, 2)]
    assert first == again
    assert any(other != first for other in others)     # the seed, not greedy decoding, makes it repeat


async def test_models_lists_the_served_name_and_unknown_model_is_not_found(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(make_daemon) as client:
            models = [m async for m in client.models.list()]
            with pytest.raises(openai.NotFoundError) as completion_error:
                await client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
            with pytest.raises(openai.NotFoundError) as chat_error:
                await client.chat.completions.create(model="no-such-model", messages=CHAT,
                                                     max_completion_tokens=2)
    assert [m.id for m in models] == [SERVED_MODEL]
    for exc in (completion_error.value, chat_error.value):
        assert exc.status_code == 404
        assert isinstance(exc.body, dict) and exc.body["code"] == "model_not_found"
        assert exc.body["param"] == "model"
