"""Several models in one daemon (issue 28), through real hypercorn on 127.0.0.1 with the real SmolLM2
and Gemma 3 270M: routing by `model`, on-demand loads, LRU swaps under --max-loaded-models, keep_alive,
a corrupt model beside a good one, and nothing left behind after a client leaves during a load.
"""

from __future__ import annotations

import shutil
import signal
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.llm import LoadedModel
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    assert_error,
    completion_text,
    data_payloads,
    engine_config,
    forge_serve,
    sample,
    scraped,
    wait_healthy,
    wait_until,
)

SMOL, GEMMA = "smollm2", "gemma-3-270m"


def several(paths: dict[str, Path], **config: Any) -> Daemon:
    entries = [ModelEntry(model_id=model_id, source=str(path), size_bytes=path.stat().st_size,
                          keep_alive=config.pop(f"keep_alive_{model_id}", None))
               for model_id, path in paths.items()]
    return Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20), gateway=GatewayConfig(),
                               models=entries, drain_timeout=5.0, **config))


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}


async def complete(client: httpx.AsyncClient, model: str, *, headers: dict[str, str] | None = None,
                   **extra: Any) -> str:
    resp = await client.post("/v1/completions", json=body(model, **extra), headers=headers)
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    assert reply["model"] == model
    return str(reply["choices"][0]["text"])


async def stream(client: httpx.AsyncClient, model: str) -> str:
    async with client.stream("POST", "/v1/completions", json=body(model, stream=True)) as resp:
        assert resp.status_code == 200
        raw = await resp.aread()
    return completion_text(data_payloads(raw))


async def single_text(path: Path, model_id: str) -> str:
    """What a one-model daemon serving `path` answers."""
    loaded = LoadedModel.load(path, progress=lambda message: None)
    daemon = Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20),
                                 gateway=GatewayConfig(served_model_name=model_id), model=str(path)), loaded)
    async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
        return await complete(client, model_id)


async def states(client: httpx.AsyncClient) -> dict[str, str]:
    resp = await client.get("/v1/models")
    assert resp.status_code == 200
    return {m["id"]: m["state"] for m in resp.json()["data"]}


async def test_two_models_stream_at_once_as_each_alone(default_model_path: Path, gemma3_model_path: Path) -> None:
    with anyio.fail_after(3 * HANG_GUARD_S):
        alone = {SMOL: await single_text(default_model_path, SMOL), GEMMA: await single_text(gemma3_model_path, GEMMA)}
        daemon = several({SMOL: default_model_path, GEMMA: gemma3_model_path})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            assert await states(client) == {SMOL: "unloaded", GEMMA: "unloaded"}
            texts: dict[str, str] = {}

            async def one(model: str) -> None:
                texts[model] = await stream(client, model)

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, SMOL)
                tg.start_soon(one, GEMMA)
            listed = (await client.get("/v1/models")).json()["data"]
            await wait_until(lambda: is_idle_all(daemon))
            stats = (await client.get("/stats")).json()
            load = (await client.get("/get_load")).json()
            metrics = (await client.get("/metrics")).text
    assert texts == alone
    for model in (SMOL, GEMMA):                     # one scrape tells the models apart
        assert scraped(metrics, "forge:request_success_total", model_name=model) == 1
        assert scraped(metrics, "vllm:request_success_total", model_name=model) == 1
        assert scraped(metrics, "forge:time_to_first_token_seconds_count", model_name=model) == 1
        assert scraped(metrics, "forge:prompt_tokens_total", model_name=model) > 0
        assert scraped(metrics, "forge:kernels_info", model_name=model) == 1
        assert scraped(metrics, "vllm:cache_config_info", model_name=model) == 1
        assert f'forge:num_requests_running{{model_name="{model}"}} 0.0' in metrics
    assert scraped(metrics, "forge:request_success_total") == 2
    assert {m["id"]: (m["state"], m["num_active"]) for m in stats["models"]} == {
        SMOL: ("loaded", 0), GEMMA: ("loaded", 0)}
    assert all(m["memory_bytes"] > m["size_bytes"] > 0 for m in stats["models"])
    assert load == {"load": 0}
    assert {m["id"]: m["state"] for m in listed} == {SMOL: "loaded", GEMMA: "loaded"}
    assert all(m["max_model_len"] == 1024 and m["size_bytes"] > 0 for m in listed)


def is_idle_all(daemon: Daemon) -> bool:
    return daemon.gateway.admission.num_inflight == 0 and all(v == 0 for v in daemon.tracked().values())


async def test_one_loaded_model_at_a_time_swaps_and_answers_each(default_model_path: Path,
                                                                 gemma3_model_path: Path) -> None:
    with anyio.fail_after(3 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, GEMMA: gemma3_model_path}, max_loaded_models=1)
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            texts = [await complete(client, model) for model in (SMOL, GEMMA, SMOL, GEMMA)]
            loaded_now = await states(client)
            metrics = (await client.get("/metrics")).text
    assert texts[0] == texts[2] and texts[1] == texts[3] and texts[0] != texts[1]
    # the unloaded model's counts stay; nothing of it is listed as in use
    assert scraped(metrics, "forge:request_success_total", model_name=SMOL) == 2
    assert scraped(metrics, "forge:kernels_info", model_name=SMOL) == 0
    assert scraped(metrics, "forge:kernels_info", model_name=GEMMA) == 1
    assert scraped(metrics, "vllm:cache_config_info", model_name=SMOL) == 0
    assert loaded_now == {SMOL: "unloaded", GEMMA: "loaded"}
    assert sample(daemon, "forge:model_swaps_total", {"model_name": SMOL}) == 2
    assert sample(daemon, "forge:model_swaps_total", {"model_name": GEMMA}) == 1
    assert 'forge:model_loads_total{model_name="smollm2"} 2.0' in metrics


async def test_one_loaded_model_at_a_time_takes_turns_under_mixed_traffic(default_model_path: Path,
                                                                          gemma3_model_path: Path) -> None:
    """--max-loaded-models 1 with both models' requests interleaved, one of them kept busy all along:
    a request for the model not loaded waits for its turn (never 503 models_busy), the busy model
    yields once that request has waited --model-turn-wait, and every request is answered as its model
    alone answers it. The wait shows in /stats and counts in each request's time to first token."""
    with anyio.fail_after(4 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, GEMMA: gemma3_model_path}, max_loaded_models=1,
                         model_turn_wait=1.0)
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            texts: dict[str, list[str]] = {SMOL: [], GEMMA: []}
            seen: list[dict[str, tuple[str, int, bool]]] = []
            done = anyio.Event()

            async def one(model: str) -> None:
                texts[model].append(await complete(client, model))

            async def busy(model: str, num: int) -> None:   # one client that always has a request in flight
                for _ in range(num):
                    await one(model)

            async def watch() -> None:
                while not done.is_set():
                    rows = (await client.get("/stats")).json()["models"]
                    seen.append({r["id"]: (r["state"], r["waiting_for_load"], r["yielding"]) for r in rows})
                    await anyio.sleep(0.1)

            async def held() -> None:      # a long request in flight across the turn: smol must yield, not idle out
                resp = await client.post("/v1/completions", json=body(SMOL, max_tokens=400, ignore_eos=True))
                assert resp.status_code == 200, resp.text
                long_lens.append(resp.json()["usage"]["completion_tokens"])

            long_lens: list[int] = []
            async with anyio.create_task_group() as watcher:
                watcher.start_soon(watch)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(busy, SMOL, 6)
                    tg.start_soon(held)
                    await wait_until(lambda: daemon.models.entries[SMOL].num_active >= 2)
                    for i in range(6):                     # and the others interleaved: gemma, smol, gemma, ...
                        tg.start_soon(one, (GEMMA, SMOL)[i % 2])
                        await anyio.sleep(0.3)
                done.set()
            await wait_until(lambda: is_idle_all(daemon))
            metrics = (await client.get("/metrics")).text
            yields = {r["id"]: r["num_yields"] for r in (await client.get("/stats")).json()["models"]}
    assert long_lens == [400]                                        # the request it drained finished whole
    assert yields[SMOL] >= 1                                         # smol gave its turn up with requests in flight
    assert len(texts[SMOL]) == 9 and len(texts[GEMMA]) == 3          # every request answered, none refused
    assert len(set(texts[SMOL])) == 1 and len(set(texts[GEMMA])) == 1 and texts[SMOL][0] != texts[GEMMA][0]
    assert scraped(metrics, "forge:request_success_total", model_name=SMOL) == 10
    assert scraped(metrics, "forge:request_success_total", model_name=GEMMA) == 3
    assert scraped(metrics, "forge:time_to_first_token_seconds_count", model_name=GEMMA) == 3
    assert scraped(metrics, "forge:time_to_first_token_seconds_sum", model_name=GEMMA) > 1.0   # waits and load
    assert scraped(metrics, "forge:request_rejected_total") == 0
    assert any(row[GEMMA][1] > 0 and row[SMOL][0] == "loaded" for row in seen)   # gemma waited while smol served
    assert any(row[SMOL][1] > 0 and row[GEMMA][0] == "loaded" for row in seen)   # and then smol waited its turn
    assert sample(daemon, "forge:model_swaps_total", {"model_name": SMOL}) >= 1
    assert sample(daemon, "forge:model_swaps_total", {"model_name": GEMMA}) >= 1


async def test_unknown_model_is_404_naming_the_available_ones(default_model_path: Path,
                                                              gemma3_model_path: Path) -> None:
    with anyio.fail_after(HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, GEMMA: gemma3_model_path})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            resp = await client.post("/v1/completions", json=body("nope"))
            unload = await client.post("/models/unload", json={"model": "nope"})
            bad = await client.post("/v1/completions", json=body(SMOL, keep_alive="soon"))
            nothing_loaded = await states(client)
    assert_error(resp, 404, param="model")
    assert "smollm2" in resp.json()["error"]["message"] and "gemma-3-270m" in resp.json()["error"]["message"]
    assert_error(unload, 404, param="model")
    assert_error(bad, 400, param="keep_alive")
    assert nothing_loaded == {SMOL: "unloaded", GEMMA: "unloaded"}


async def test_a_corrupt_model_fails_its_requests_and_the_other_serves(
        tmp_path: Path, default_model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.gguf"
    with open(default_model_path, "rb") as src, open(broken, "wb") as dst:
        dst.write(src.read(1 << 16))                   # a truncated copy: the header, then nothing
    with anyio.fail_after(2 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, "broken": broken})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            failed = await client.post("/v1/completions", json=body("broken"))
            good = await complete(client, SMOL)
            listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
            health = await client.get("/healthz")
    assert_error(failed, 500)
    assert failed.json()["error"]["code"] == "model_load_failed" and "broken" in failed.json()["error"]["message"]
    assert good
    assert listed["broken"]["state"] == "unloaded" and listed["broken"]["error"]
    assert listed[SMOL]["state"] == "loaded"
    assert health.status_code == 200
    access = [line for line in capsys.readouterr().out.splitlines() if "access" in line and "/v1/completions" in line]
    assert "model=broken" in access[0] and "status=500" in access[0]
    assert "model=smollm2" in access[1] and "status=200" in access[1]


async def test_keep_alive_unloads_and_the_next_request_reloads(default_model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "second.gguf"
    shutil.copyfile(default_model_path, copy)
    with anyio.fail_after(2 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, "second": copy})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            first = await complete(client, SMOL, keep_alive=0)    # Ollama's field: unload once idle
            while (await states(client))[SMOL] != "unloaded":
                await anyio.sleep(0.05)
            second = await complete(client, SMOL, keep_alive=-1)
            after = await states(client)
            await wait_until(lambda: is_idle_all(daemon))
    assert first == second
    assert after[SMOL] == "loaded"
    assert sample(daemon, "forge:model_loads_total", {"model_name": SMOL}) == 2


async def test_a_client_leaving_during_a_load_leaves_nothing_behind(default_model_path: Path,
                                                                    gemma3_model_path: Path) -> None:
    with anyio.fail_after(2 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, GEMMA: gemma3_model_path})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(client.post, "/v1/completions", json=body(GEMMA)))
                while (await states(client))[GEMMA] != "loading":
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()                   # the client goes away while the model loads
            while (await states(client))[GEMMA] != "loaded":
                await anyio.sleep(0.05)
            await wait_until(lambda: is_idle_all(daemon))
            assert daemon.models is not None and daemon.models.entries[GEMMA].num_active == 0
            text = await complete(client, GEMMA)
            await wait_until(lambda: is_idle_all(daemon))
    assert text


async def test_forge_serve_with_two_models_loads_and_unloads_for_the_operator(
        tmp_path: Path, default_model_path: Path, gemma3_model_path: Path) -> None:
    """As a user starts it: two --model flags (an ID=PATH and a catalog name), --preload, the API key on
    POST /models/load and /models/unload, and SIGTERM draining both."""
    serve = forge_serve(tmp_path, ["--model", f"{SMOL}={default_model_path}", "--model", GEMMA, "--preload", SMOL,
                                   "--max-loaded-models", "1", "--api-key", "k", "--kv-cache-memory", "64MiB",
                                   "--kv-cache-commit", "off"], forge_home=gemma3_model_path.parent.parent)
    auth = {"Authorization": "Bearer k"}
    async with serve as (proc, port, log):
        with anyio.fail_after(2 * HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, lambda: log.read_text()[-4000:], interval=0.2)
                at_start = {m["id"]: m["state"] for m in (await http.get("/v1/models", headers=auth)).json()["data"]}
                no_key = await http.post("/models/load", json={"model": GEMMA})
                loaded = await http.post("/models/load", json={"model": GEMMA}, headers=auth)
                after_load = {m["id"]: m["state"]
                              for m in (await http.get("/v1/models", headers=auth)).json()["data"]}
                text = await complete(http, GEMMA, headers=auth)
                unloaded = await http.post("/models/unload", json={"model": GEMMA}, headers=auth)
                bad = await http.post("/models/unload", content=b"{", headers=auth)
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0, log.read_text()[-4000:]
    assert at_start == {SMOL: "loaded", GEMMA: "unloaded"}
    assert_error(no_key, 401)
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
    assert after_load == {SMOL: "unloaded", GEMMA: "loaded"}           # one at a time: smollm2 made room
    assert text
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
    assert_error(bad, 400, param="model")


async def test_every_route_finds_the_model_its_body_names(default_model_path: Path, gemma3_model_path: Path) -> None:
    """The Responses and Messages APIs, count_tokens, embeddings, /tokenize and the render routes resolve
    the model as chat and completions do: by the body's `model` (once 404 for a model /v1/models lists),
    and each answers under that model's name."""
    chat = [{"role": "user", "content": "Hi"}]
    with anyio.fail_after(4 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, GEMMA: gemma3_model_path})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            seen: dict[str, dict[str, Any]] = {}
            for model in (SMOL, GEMMA):
                replies = {
                    "chat": await client.post("/v1/chat/completions",
                                              json={"model": model, "messages": chat, "max_tokens": 4}),
                    "responses": await client.post("/v1/responses",
                                                   json={"model": model, "input": "Hi", "max_output_tokens": 4}),
                    "messages": await client.post("/v1/messages",
                                                  json={"model": model, "messages": chat, "max_tokens": 4}),
                    "count_tokens": await client.post("/v1/messages/count_tokens",
                                                      json={"model": model, "messages": chat}),
                    "embeddings": await client.post("/v1/embeddings", json={"model": model, "input": "Hi"}),
                    "tokenize": await client.post("/tokenize", json={"model": model, "prompt": PROMPT}),
                    "render": await client.post("/v1/completions/render", json={"model": model, "prompt": PROMPT}),
                    "render_chat": await client.post("/v1/chat/completions/render",
                                                     json={"model": model, "messages": chat}),
                }
                for route, resp in replies.items():
                    assert resp.status_code == 200, (model, route, resp.text)
                seen[model] = {route: resp.json() for route, resp in replies.items()}
                for route in ("chat", "responses", "messages", "embeddings"):
                    assert seen[model][route]["model"] == model, (model, route)
                tokens = seen[model]["tokenize"]["tokens"]
                detok = await client.post("/detokenize", json={"model": model, "tokens": tokens})
                assert detok.status_code == 200 and PROMPT in detok.json()["prompt"], detok.text
                assert seen[model]["render"]["token_ids"] == tokens
            # No model named: the Responses API answers under the model that served it, which a follow-up
            # naming it (and the response before it) is served by.
            first = await client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4})
            assert first.status_code == 200, first.text
            follow = await client.post("/v1/responses", json={
                "model": first.json()["model"], "input": "And?", "max_output_tokens": 4,
                "previous_response_id": first.json()["id"]})
            assert follow.status_code == 200 and follow.json()["model"] == first.json()["model"], follow.text
            await wait_until(lambda: is_idle_all(daemon))
    # two tokenizers: the same text, other ids
    assert seen[SMOL]["tokenize"]["tokens"] != seen[GEMMA]["tokenize"]["tokens"]
    assert seen[SMOL]["count_tokens"]["input_tokens"] != seen[GEMMA]["count_tokens"]["input_tokens"]


async def test_an_embedding_model_serves_beside_a_generation_model(default_model_path: Path,
                                                                   minilm_model_dir: Path) -> None:
    """An embedding model is one more entry of the set: embeddings by its id, chat by the other's, and a
    generation route naming the embedding model is the same 400 a daemon serving it alone gives."""
    chat = [{"role": "user", "content": "Hi"}]
    with anyio.fail_after(2 * HANG_GUARD_S):
        daemon = several({SMOL: default_model_path, "minilm": minilm_model_dir})
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as client:
            embedded = await client.post("/v1/embeddings", json={"model": "minilm", "input": ["Hi", "there"]})
            chatted = await client.post("/v1/chat/completions", json={"model": SMOL, "messages": chat,
                                                                       "max_tokens": 4})
            refused = await client.post("/v1/chat/completions", json={"model": "minilm", "messages": chat})
            listed = {m["id"]: m["state"] for m in (await client.get("/v1/models")).json()["data"]}
            await wait_until(lambda: is_idle_all(daemon))
    assert embedded.status_code == 200, embedded.text
    vectors = [item["embedding"] for item in embedded.json()["data"]]
    assert embedded.json()["model"] == "minilm" and [len(v) for v in vectors] == [384, 384]
    assert chatted.status_code == 200 and chatted.json()["model"] == SMOL, chatted.text
    assert_error(refused, 400, param="model")
    assert refused.json()["error"]["code"] == "model_only_embeds"
    assert listed == {SMOL: "loaded", "minilm": "loaded"}
