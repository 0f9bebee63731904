"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, ...) through the official `ollama` Python
client against the real server and the real models: a chat is the chat completion of the same messages,
streamed (NDJSON) or not; generate with the template and raw; `format` as JSON and as a schema; a tool
conversation round-trips; embeddings are /v1/embeddings'; the model routes describe what is served; errors
are Ollama's error object with the right status; the API key and the browser guard apply; a reasoning
model's section is `message.thinking`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import jsonschema
import ollama
import pytest

from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.llm import LoadedModel
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_ollama_error,
    engine_config,
    wait_idle,
    wait_until,
)
from tests.integration.test_reasoning import QWEN3_TEMPLATE, R1_TEMPLATE, model_with, thinking_tokenizer
from tests.integration.test_reasoning import serving as reasoning_serving

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 16}
KEY = "0llama-Key-9"
SMOL, MINILM = "smollm2", "minilm"
PERSON = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}


@asynccontextmanager
async def serving(daemon: Daemon, **client: Any) -> AsyncIterator[tuple[ollama.AsyncClient, httpx.AsyncClient]]:
    async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
        async with ollama.AsyncClient(host=url, timeout=HANG_GUARD_S, **client) as ollama_client:
            yield ollama_client, http


async def openai_chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    resp = await http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 16,
                                                          **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]  # type: ignore[no-any-return]


def assert_final(part: ollama.ChatResponse | ollama.GenerateResponse, reason: str) -> None:
    """The last object: done, its reason, its counts and timings (nanoseconds, the parts within the whole)."""
    assert part.done and part.done_reason == reason
    assert part.prompt_eval_count and part.prompt_eval_count > 0 and part.eval_count and part.eval_count > 0
    assert part.total_duration and part.eval_duration and part.prompt_eval_duration is not None
    assert part.load_duration is not None
    assert part.prompt_eval_duration + part.eval_duration + part.load_duration <= part.total_duration


async def test_a_chat_is_the_chat_completion_of_the_same_messages_streamed_or_not(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, http):
            expected = await openai_chat(http, QUESTION)
            plain = await client.chat(model=SERVED_MODEL, messages=QUESTION, options=GREEDY, stream=False)
            parts = [p async for p in await client.chat(model=f"{SERVED_MODEL}:latest", messages=QUESTION,
                                                         options=GREEDY, stream=True)]
            raw = await http.post("/api/chat", json={"model": SERVED_MODEL, "messages": QUESTION, "options": GREEDY})
            await wait_idle(daemon)
    reason = "length" if expected["finish_reason"] == "length" else "stop"
    assert plain.message.role == "assistant" and plain.message.content == expected["message"]["content"]
    assert plain.model == SERVED_MODEL
    assert_final(plain, reason)
    assert "".join(p.message.content or "" for p in parts) == expected["message"]["content"]
    assert all(not p.done for p in parts[:-1]) and parts[-1].message.content == ""
    assert_final(parts[-1], reason)
    assert parts[-1].model == f"{SERVED_MODEL}:latest"           # the name as the request gave it
    # the wire: one JSON object per line, Ollama's media type, streamed by default
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/x-ndjson")
    lines = raw.text.splitlines()
    objects = [json.loads(line) for line in lines]
    assert len(objects) > 2 and objects[-1]["done"] is True and all(o["done"] is False for o in objects[:-1])


async def test_generate_runs_the_prompt_through_the_template_or_raw(make_daemon: MakeDaemon) -> None:
    system = "Answer in one short sentence."
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, http):
            chat = await openai_chat(http, [{"role": "system", "content": system}, *QUESTION])
            templated = await client.generate(model=SERVED_MODEL, prompt=QUESTION[0]["content"], system=system,
                                              options=GREEDY)
            completion = (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                                                  "temperature": 0})).json()
            raw = await client.generate(model=SERVED_MODEL, prompt=PROMPT, raw=True,
                                        options={"temperature": 0, "num_predict": 8})
            streamed = [p async for p in await client.generate(model=SERVED_MODEL, prompt=PROMPT, raw=True,
                                                                options={"temperature": 0, "num_predict": 8},
                                                                stream=True)]
            loaded = await client.generate(model=SERVED_MODEL)          # no prompt: load the model, say so
            await wait_idle(daemon)
    assert templated.response == chat["message"]["content"]
    assert_final(templated, "length" if chat["finish_reason"] == "length" else "stop")
    assert raw.response == completion["choices"][0]["text"]
    assert_final(raw, "length")
    assert "".join(p.response or "" for p in streamed) == raw.response and streamed[-1].done
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


async def test_format_constrains_the_reply_to_json_or_a_schema(make_daemon: MakeDaemon) -> None:
    ask = [{"role": "user", "content": "Tom is 71. Give his name and age as JSON."}]
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, _http):
            any_json = await client.chat(model=SERVED_MODEL, messages=ask, format="json",
                                         options={"temperature": 0, "num_predict": 48})
            person = await client.chat(model=SERVED_MODEL, messages=ask, format=PERSON,
                                       options={"temperature": 0, "num_predict": 48})
            generated = await client.generate(model=SERVED_MODEL, prompt=ask[0]["content"], format=PERSON,
                                              options={"temperature": 0, "num_predict": 48})
            await wait_idle(daemon)
    assert isinstance(json.loads(any_json.message.content or ""), dict)
    jsonschema.validate(json.loads(person.message.content or ""), PERSON)
    jsonschema.validate(json.loads(generated.response or ""), PERSON)


async def test_a_tool_conversation_round_trips_as_chats_does(make_daemon: MakeDaemon) -> None:
    """The client's tool shapes (calls with arguments as objects, a tool turn naming its tool) are the chat
    conversation OpenAI's API sends (arguments as JSON text, the call's id): the same reply, greedy."""
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    ollama_turns = [ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Sunny, 24 degrees.", "tool_name": "get_weather"}]
    openai_turns = [ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "Sunny, 24 degrees.", "tool_call_id": "call_0", "name": "get_weather"}]
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, http):
            expected = await openai_chat(http, openai_turns, tools=[WEATHER])
            reply = await client.chat(model=SERVED_MODEL, messages=ollama_turns, tools=[WEATHER], options=GREEDY)
            await wait_idle(daemon)
    calls = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in expected["message"].get("tool_calls") or []]
    assert [c.model_dump() for c in reply.message.tool_calls or []] == calls
    assert (reply.message.content or None) == expected["message"]["content"]


async def test_errors_are_ollamas_error_object_with_the_right_status(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon) as (client, http):
            for call, status in [
                (client.chat(model="no-such-model", messages=QUESTION), 404),
                (client.chat(model=SERVED_MODEL, messages=QUESTION, options={"temperature": "hot"}), 400),
                (client.chat(model=SERVED_MODEL, messages=QUESTION, options={"top_p": 7}), 400),
                (client.chat(model=SERVED_MODEL, messages=QUESTION, options={"num_ctx": 10**6}), 400),
                (client.chat(model=SERVED_MODEL, messages=QUESTION, think=True), 400),     # not a thinking model
                (client.chat(model=SERVED_MODEL, messages=[{**QUESTION[0], "images": [b"\x89PNG"]}]), 400),
                (client.generate(model=SERVED_MODEL, prompt="def f(", suffix="return 1"), 400),
                (client.generate(model=SERVED_MODEL, prompt="Hi", template="{{ .Prompt }}"), 400),
                (client.show("no-such-model"), 404),
                (client.pull("smollm2"), 501),
                (client.delete(SERVED_MODEL), 501),
                (client.copy(SERVED_MODEL, "other"), 501),
            ]:
                with pytest.raises(ollama.ResponseError) as err:
                    await call
                assert err.value.status_code == status, err.value
            unknown = await http.post("/api/no-such-route", json={})
            bad_json = await http.post("/api/chat", content=b"{not json")
            await wait_idle(daemon)
    assert_ollama_error(unknown, 404, naming="/api/no-such-route")
    assert_ollama_error(bad_json, 400, naming="JSON")


async def test_the_api_key_and_the_browser_guard_apply(make_daemon: MakeDaemon) -> None:
    """Ollama's clients send the key as `Authorization: Bearer` (headers=...); without it every route is
    a 401 in Ollama's error object; a page on another site is refused as on every route."""
    daemon = make_daemon(gateway={"api_key": KEY})
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(daemon, headers={"Authorization": f"Bearer {KEY}"}) as (client, http):
            listed = await client.list()
            reply = await client.chat(model=SERVED_MODEL, messages=QUESTION, options=GREEDY)
            async with ollama.AsyncClient(host=str(http.base_url), timeout=HANG_GUARD_S) as keyless:
                with pytest.raises(ollama.ResponseError) as err:
                    await keyless.chat(model=SERVED_MODEL, messages=QUESTION)
            foreign = await http.post("/api/chat", content=json.dumps({"model": SERVED_MODEL, "messages": QUESTION}),
                                      headers={"Origin": "http://evil.example", "Content-Type": "text/plain",
                                               "Authorization": f"Bearer {KEY}"})
            await wait_idle(daemon)
    assert [m.model for m in listed.models] == [f"{SERVED_MODEL}:latest"]
    assert reply.message.content and err.value.status_code == 401
    assert_ollama_error(foreign, 403)


async def test_models_embeddings_and_names_with_two_models(default_model_path: Path, minilm_model_dir: Path) -> None:
    """A generation model and an embedding model in one daemon: /api/embed's vectors are /v1/embeddings'
    (the legacy /api/embeddings' too), tags describe both from their files, ps the loaded ones, show each
    one's capabilities, template and metadata, version answers."""
    entries = [ModelEntry(model_id=SMOL, source=str(default_model_path), size_bytes=default_model_path.stat().st_size),
               ModelEntry(model_id=MINILM, source=str(minilm_model_dir))]
    daemon = Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20), gateway=GatewayConfig(),
                                 models=entries, drain_timeout=5.0))
    texts = ["Hello there", "The capital of France is Paris."]
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with serving(daemon) as (client, http):
            embedded = await client.embed(model=f"{MINILM}:latest", input=texts)
            legacy = await client.embeddings(model=MINILM, prompt=texts[0])
            openai = (await http.post("/v1/embeddings", json={"model": MINILM, "input": texts})).json()
            chatted = await client.chat(model=SMOL, messages=QUESTION, options={"temperature": 0, "num_predict": 4})
            tags, ps = await client.list(), await client.ps()
            shown = {name: await client.show(name) for name in (SMOL, MINILM)}
            version = (await http.get("/api/version")).json()
            # keep_alive 0 with nothing to generate: Ollama's way to unload a model (once it is idle)
            unload = await client.generate(model=SMOL, keep_alive=0)
            await wait_until(lambda: daemon.models is not None and daemon.models.entries[SMOL].state == "unloaded")
            after = await client.ps()
    vectors = [item["embedding"] for item in openai["data"]]
    assert len(embedded.embeddings) == 2
    for got, want in zip(embedded.embeddings, vectors, strict=True):
        assert list(got) == pytest.approx(want, abs=1e-6)
    assert list(legacy.embedding) == pytest.approx(vectors[0], abs=1e-6)
    assert embedded.prompt_eval_count and embedded.prompt_eval_count > 0
    assert chatted.message.content and chatted.done_reason == "length"
    listed = {m.model: m for m in tags.models}
    assert set(listed) == {f"{SMOL}:latest", f"{MINILM}:latest"}
    smol, minilm = listed[f"{SMOL}:latest"].details, listed[f"{MINILM}:latest"].details
    assert smol is not None and (smol.format, smol.family, smol.quantization_level) == ("gguf", "llama", "Q4_1")
    assert smol.parameter_size == "134.52M"
    assert minilm is not None and (minilm.format, minilm.family) == ("safetensors", "bert")
    assert listed[f"{SMOL}:latest"].size == default_model_path.stat().st_size
    assert all(m.digest and len(m.digest) == 64 for m in tags.models)
    assert {m.model for m in ps.models} == {f"{SMOL}:latest", f"{MINILM}:latest"}    # both were used
    assert all(m.context_length for m in ps.models if m.model == f"{SMOL}:latest")
    assert shown[SMOL].capabilities == ["completion", "tools"] and shown[MINILM].capabilities == ["embedding"]
    assert "<|im_start|>" in (shown[SMOL].template or "")
    assert (shown[SMOL].modelinfo or {})["llama.context_length"] == 8192
    assert (shown[SMOL].modelinfo or {})["general.parameter_count"] == 134515008
    assert version["version"] and "forge_version" in version
    assert unload.done_reason == "unload" and [m.model for m in after.models] == [f"{MINILM}:latest"]


async def test_a_reasoning_models_section_is_the_messages_thinking(loaded: LoadedModel,
                                                                   default_model_path: Path) -> None:
    """The default model's weights behind tokens renamed `<think>`/`</think>` and a template that opens the
    section (tests/integration/test_reasoning.py): `think` true gives the section as `message.thinking`, the
    same text chat gives as reasoning_content, streamed or not; `think` false under a template that can
    leave the section out is chat's answer without one."""
    tok = thinking_tokenizer(default_model_path)
    opts = {"temperature": 0, "num_predict": 24}
    for template, think in ((R1_TEMPLATE, True), (QWEN3_TEMPLATE, False)):
        model = model_with(loaded, tok, template)
        extra: dict[str, Any] = {} if think else {"thinking_budget": 0,
                                                  "chat_template_kwargs": {"enable_thinking": False}}
        with anyio.fail_after(HANG_GUARD_S):
            async with reasoning_serving(model) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                expected = await openai_chat(http, QUESTION, max_tokens=24, **extra)
                async with ollama.AsyncClient(host=url, timeout=HANG_GUARD_S) as client:
                    plain = await client.chat(model=SERVED_MODEL, messages=QUESTION, think=think, options=opts)
                    parts = [p async for p in await client.chat(model=SERVED_MODEL, messages=QUESTION, think=think,
                                                                 options=opts, stream=True)]
        reasoning = expected["message"].get("reasoning_content") or None
        assert (plain.message.thinking or None) == reasoning and (reasoning is not None) == think
        assert (plain.message.content or "") == (expected["message"]["content"] or "")
        assert "".join(p.message.thinking or "" for p in parts) == (reasoning or "")
        assert "".join(p.message.content or "" for p in parts) == (expected["message"]["content"] or "")
