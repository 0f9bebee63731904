"""POST /v1/embeddings on the served decoder, through the real daemon: the openai client (which asks
for base64 unless told otherwise, and decodes it), floats, lists of strings and of token ids,
`dimensions`, embeddings batched beside chat streams, and the requests that must be a 400 or 404."""

from __future__ import annotations

import base64
import json

import anyio
import httpx
import numpy as np
import openai
import pytest

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, PROMPT, SERVED_MODEL, MakeDaemon, assert_error, is_idle, wait_until

TEXTS = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock markets fell sharply today."]
HIDDEN = 576                        # the default model's hidden size


def unit(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-4
    return a


async def test_the_openai_client_embeds_in_float_and_base64(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                          timeout=HANG_GUARD_S) as client:
                default = await client.embeddings.create(model=SERVED_MODEL, input=TEXTS)   # base64 on the wire
                floats = await client.embeddings.create(model=SERVED_MODEL, input=TEXTS, encoding_format="float")
                one = await client.embeddings.create(model=SERVED_MODEL, input=TEXTS[0], encoding_format="float",
                                                     user="someone")
                short = await client.embeddings.create(model=SERVED_MODEL, input=TEXTS, dimensions=64,
                                                       encoding_format="float")
    assert default.object == "list" and default.model == SERVED_MODEL
    assert [d.index for d in default.data] == [0, 1, 2] and all(d.object == "embedding" for d in default.data)
    for a, b in zip(default.data, floats.data, strict=True):
        assert len(a.embedding) == HIDDEN
        np.testing.assert_allclose(unit(a.embedding), unit(b.embedding), atol=1e-6)
    np.testing.assert_allclose(unit(one.data[0].embedding), unit(floats.data[0].embedding), atol=1e-5)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 3 * 5
    assert one.usage.prompt_tokens * 3 <= floats.usage.prompt_tokens + 6
    for full, cut in zip(floats.data, short.data, strict=True):
        head = np.asarray(full.embedding[:64])
        np.testing.assert_allclose(unit(cut.embedding), head / np.linalg.norm(head), atol=1e-5)
    v = [unit(d.embedding) for d in floats.data]
    assert v[0] @ v[1] > v[0] @ v[2]                            # the cat is nearer the kitten than the markets


async def test_token_ids_embed_as_their_text_does(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            ids = (await http.post("/tokenize", json={"prompt": TEXTS[0]})).json()["tokens"]
            text = (await http.post("/v1/embeddings", json={"input": TEXTS[0]})).json()
            flat = (await http.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"})).json()
            nested = (await http.post("/v1/embeddings", json={"input": [ids, ids[:3]]})).json()
    want = np.asarray(text["data"][0]["embedding"])
    got = np.frombuffer(base64.b64decode(flat["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(nested["data"][0]["embedding"], want, atol=1e-5)
    assert len(nested["data"]) == 2 and nested["usage"]["prompt_tokens"] == len(ids) + 3


async def test_embeddings_batch_beside_chat_streams(make_daemon: MakeDaemon) -> None:
    """Both complete, together, and the greedy chat text is what it is alone."""
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
            "temperature": 0}
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            alone = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]["message"]["content"]
            want = (await http.post("/v1/embeddings", json={"input": TEXTS})).json()
            texts: list[str] = []
            vectors: list[dict[str, object]] = []

            async def stream() -> None:
                async with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as resp:
                    body = b"".join([chunk async for chunk in resp.aiter_bytes()])
                pieces = [line.removeprefix(b"data: ") for line in body.split(b"\n") if line.startswith(b"data: {")]
                texts.append("".join(json.loads(p)["choices"][0]["delta"].get("content") or ""
                                     for p in pieces if json.loads(p)["choices"]))

            async def embed() -> None:
                vectors.append((await http.post("/v1/embeddings", json={"input": TEXTS})).json())

            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(stream)
                    tg.start_soon(embed)
            await wait_until(lambda: is_idle(daemon))
    assert texts == [alone] * 3
    for got in vectors:
        for a, b in zip(got["data"], want["data"], strict=True):  # type: ignore[call-overload]
            np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-4)


@pytest.mark.parametrize(("body", "param", "status"), [
    ({"input": ""}, "input", 400),
    ({"input": []}, "input", 400),
    ({"input": ["a", ""]}, "input[1]", 400),
    ({"input": [[1, 2], []]}, "input[1]", 400),
    ({"input": ["a", [1]]}, "input[1]", 400),
    ({"input": ["a"] * 2049}, "input", 400),
    ({"input": [10**9]}, "input", 400),
    ({"input": [-1]}, "input[0]", 400),
    ({"input": None}, "input", 400),
    ({}, "input", 400),
    ({"input": "a", "dimensions": 0}, "dimensions", 400),
    ({"input": "a", "dimensions": HIDDEN + 1}, "dimensions", 400),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", 400),
    ({"input": "a", "model": "nope"}, "model", 404),
    ({"input": " apple" * 1100}, "input", 400),                        # past the 1,024-token context
])
async def test_bad_embedding_requests_are_refused_naming_the_field(make_daemon: MakeDaemon, body: dict[str, object],
                                                                   param: str, status: int) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            resp = await http.post("/v1/embeddings", json=body)
            await wait_until(lambda: is_idle(daemon))
    assert_error(resp, status, param=param)


async def test_a_completion_still_runs_after_embeddings(make_daemon: MakeDaemon) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            await http.post("/v1/embeddings", json={"input": [PROMPT] * 4})
            resp = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert "Paris" in resp.json()["choices"][0]["text"]
