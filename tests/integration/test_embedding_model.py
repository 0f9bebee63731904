"""all-MiniLM-L6-v2 served by the real daemon (the BERT encoder family): POST /v1/embeddings through the
openai client matches sentence-transformers' reference vectors, concurrent requests are batched and all
answered, long inputs are truncated as the model's config says, and every generation route is a clear 400."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.models.bert.encoder import LoadedEncoder
from tests.integration.harness import HANG_GUARD_S, assert_error, engine_config, is_idle, wait_until

NAME = "minilm"
DATA: dict[str, Any] = json.loads((Path(__file__).resolve().parents[1] / "data" / "minilm_reference.json")
                                  .read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def encoder(minilm_model_dir: Path) -> LoadedEncoder:
    return LoadedEncoder.load(minilm_model_dir)


def daemon_of(encoder: LoadedEncoder) -> Daemon:
    config = DaemonConfig(engine=engine_config(), gateway=GatewayConfig(served_model_name=NAME),
                          model=encoder.path, drain_timeout=5.0)
    return Daemon(config, encoder)


def reference(i: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(DATA["cases"][i]["vector"]), dtype="<f4")


async def test_the_openai_client_gets_sentence_transformers_vectors(encoder: LoadedEncoder) -> None:
    texts = [c["text"] for c in DATA["cases"]]
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon_of(encoder)) as url:
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                          timeout=HANG_GUARD_S) as client:
                got = await client.embeddings.create(model=NAME, input=texts)
                floats = await client.embeddings.create(model=NAME, input=texts[:3], encoding_format="float",
                                                        dimensions=128)
                models = await client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert got.usage.prompt_tokens == sum(len(c["ids"]) for c in DATA["cases"])   # truncated at 256
    for i, item in enumerate(got.data):
        assert item.index == i and len(item.embedding) == 384
        assert float(np.asarray(item.embedding) @ reference(i)) > 0.9999, texts[i][:40]
    for i, item in enumerate(floats.data):
        head = reference(i)[:128]
        assert float(np.asarray(item.embedding) @ (head / np.linalg.norm(head))) > 0.9999


async def test_concurrent_requests_are_all_answered_and_nothing_is_kept(encoder: LoadedEncoder) -> None:
    daemon = daemon_of(encoder)
    answers: dict[int, list[float]] = {}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            async def one(i: int) -> None:
                resp = await http.post("/v1/embeddings", json={"input": DATA["cases"][i]["text"],
                                                               "encoding_format": "float"})
                answers[i] = resp.json()["data"][0]["embedding"]

            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(one, i)
            ids = await http.post("/v1/embeddings", json={"input": [DATA["cases"][0]["ids"]]})
            await wait_until(lambda: is_idle(daemon))
    for i, vector in answers.items():
        assert float(np.asarray(vector) @ reference(i)) > 0.9999
    assert float(np.asarray(ids.json()["data"][0]["embedding"]) @ reference(0)) > 0.9999


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"prompt": "hi"}),
    ("POST", "/v1/messages", {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/generate", {"prompt": "hi"}),
    ("POST", "/tokenize", {"prompt": "hi"}),
])
async def test_generation_routes_say_the_model_only_embeds(encoder: LoadedEncoder, method: str, path: str,
                                                           body: dict[str, object]) -> None:
    daemon = daemon_of(encoder)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            resp = await http.request(method, path, json=body)
            await wait_until(lambda: is_idle(daemon))
    assert resp.status_code == 400, resp.text
    assert "only POST /v1/embeddings" in resp.text
    if not path.startswith("/v1/messages"):
        assert_error(resp, 400, param="model", code="model_only_embeds")


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [[101] * 257]}, "input[0]"),
    ({"input": [30522]}, "input"),
    ({"input": "a", "dimensions": 385}, "dimensions"),
    ({"input": ""}, "input"),
])
async def test_bad_inputs_are_refused_naming_the_field(encoder: LoadedEncoder, body: dict[str, object],
                                                       param: str) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon_of(encoder)) as url, \
                httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            resp = await http.post("/v1/embeddings", json=body)
    assert_error(resp, 400, param=param)
