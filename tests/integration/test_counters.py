"""Counters that count: what the engine did under pressure shows in /metrics (forge's and vLLM's names)
and on the dashboard's data (/stats), read while the daemon runs, never reset before the read."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx

from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.llm import LoadedModel
from forge.models.llama.kv_cache import KVCache
from tests.integration.harness import (
    HANG_GUARD_S,
    SERVED_MODEL,
    MakeDaemon,
    data_payloads,
    engine_config,
    long_prompt,
    scraped,
    wait_idle,
)

BLOCK_SIZE = 16
NUM_BLOCKS = 8                  # 128 tokens: one sequence of max_model_len, and no more


async def test_preemptions_under_kv_exhaustion_reach_the_metrics_and_the_dashboard(
        make_daemon: MakeDaemon, loaded: LoadedModel) -> None:
    per_block = KVCache.bytes_per_block(loaded.model.config, BLOCK_SIZE, "float16")
    daemon = make_daemon(kv_cache_memory=NUM_BLOCKS * per_block, block_size=BLOCK_SIZE, max_model_len=128,
                         max_num_seqs=4, enable_prefix_caching=False)
    prompts = [f"Story number {i}: once upon a time" for i in range(4)]
    texts: dict[int, str] = {}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            async def stream(i: int) -> None:
                body = {"model": SERVED_MODEL, "prompt": prompts[i], "max_tokens": 100, "ignore_eos": True,
                        "temperature": 0, "stream": True}
                resp = await http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                texts[i] = "".join(p["choices"][0]["text"] for p in data_payloads(resp.content) if p["choices"])

            # Four sequences of ~110 tokens (7 blocks each) in 8 blocks: the allocator must take blocks back.
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(stream, i)
            await wait_idle(daemon)
            assert daemon.scheduler is not None
            num_preempted = daemon.scheduler.statistics().num_preemptions
            page = (await http.get("/metrics")).text
            stats = (await http.get("/stats")).json()
            alone = (await http.post("/v1/completions", json={
                "model": SERVED_MODEL, "prompt": prompts[3], "max_tokens": 100, "ignore_eos": True,
                "temperature": 0})).json()["choices"][0]["text"]
    preemptions = scraped(page, "forge:num_preemptions_total", model_name=SERVED_MODEL)
    assert num_preempted > 0                    # the engine did preempt (four sequences cannot share 8 blocks)
    assert preemptions == num_preempted
    assert scraped(page, "vllm:num_preemptions_total", model_name=SERVED_MODEL) == preemptions
    assert stats["totals"]["preemptions"] == preemptions
    assert texts[3] == alone                    # preempted and recomputed, the text is the same


async def test_an_unloaded_models_cache_counts_since_the_last_scrape_are_kept(default_model_path: Path) -> None:
    # The allocator keeps the prefix cache's running totals; a scrape carries them into the counters. An
    # unload drops the allocator: what it counted since the last scrape must reach the counters first.
    entry = ModelEntry(model_id="smollm2", source=str(default_model_path), size_bytes=default_model_path.stat().st_size)
    daemon = Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20), gateway=GatewayConfig(),
                                 models=[entry], drain_timeout=5.0))
    body = {"model": "smollm2", "prompt": long_prompt(40), "max_tokens": 2, "temperature": 0}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            for _ in range(2):                            # the second finds the first's prompt cached
                assert (await http.post("/v1/completions", json=body)).status_code == 200
            assert (await http.post("/models/unload", json={"model": "smollm2"})).status_code == 200
            page = (await http.get("/metrics")).text
    assert scraped(page, "forge:prefix_cache_queries_total", model_name="smollm2") > 80
    assert scraped(page, "forge:prefix_cache_hits_total", model_name="smollm2") >= 64
    assert scraped(page, "vllm:prefix_cache_hits_total", model_name="smollm2") >= 64
