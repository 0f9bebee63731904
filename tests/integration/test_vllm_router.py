"""Two forge replicas behind the real vLLM router (`vllm-router`, a test dependency), each policy that needs
only the HTTP worker contract (round_robin, power_of_two, cache_aware): every request answered correctly,
plain and streamed, through the router with no shim, and no replica answering 404 to anything the router
asks (/health, /get_load, the render routes, /flush_cache). cache_aware keeps a conversation's repeats on one
replica.
"""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.models.loading import LoadedModel
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, MakeDaemon, engine_config, free_port, wait_router

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
SYSTEM = ("You are a patient assistant for a museum of clocks. Answer briefly and kindly, and never invent "
          "opening hours. The museum holds three hundred clocks from six centuries. ") * 3


class Recording(Daemon):
    """A daemon that counts its responses by (method, path, status)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.responses: Counter[tuple[str, str, int]] = Counter()

    def app(self) -> Any:
        inner = super().app()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await inner(scope, receive, send)

            async def noted(message: Any) -> None:
                if message["type"] == "http.response.start":
                    self.responses[(scope["method"], scope["path"], message["status"])] += 1
                await send(message)
            await inner(scope, receive, noted)

        return app

    def count(self, path: str, status: int | None = None) -> int:
        return sum(n for (_, p, s), n in self.responses.items() if p == path and status in (None, s))


@asynccontextmanager
async def fleet(loaded: LoadedModel, default_model_path: Path, policy: str
                ) -> AsyncIterator[tuple[list[Recording], openai.AsyncOpenAI]]:
    assert ROUTER is not None, "vllm-router is a test dependency: pip install -e '.[test]'"
    async with AsyncExitStack() as stack:
        config = DaemonConfig(engine=engine_config(max_num_seqs=4), model=str(default_model_path),
                              gateway=GatewayConfig(served_model_name=SERVED_MODEL))
        replicas = [Recording(config, loaded) for _ in range(2)]
        urls = [await stack.enter_async_context(running_daemon(r)) for r in replicas]
        port = free_port()
        router = await anyio.open_process(
            [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
             "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port()), "--log-level", "warning"],
            stdout=None, stderr=None)
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_router(base)
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                          timeout=HANG_GUARD_S) as client:
                yield replicas, client
        finally:
            router.terminate()
            await router.wait()


def ask(question: str) -> list[Any]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "cache_aware"])
async def test_the_router_serves_forge_replicas_with_no_shim(loaded: LoadedModel, default_model_path: Path,
                                                             policy: str) -> None:
    with anyio.fail_after(3 * HANG_GUARD_S):
        async with fleet(loaded, default_model_path, policy) as (replicas, client):
            if policy == "power_of_two":
                while not all(r.count("/get_load", 200) for r in replicas):     # the router polls each one
                    await anyio.sleep(0.2)
            plain = [await client.chat.completions.create(model=SERVED_MODEL, messages=ask("When was it built?"),
                                                          temperature=0, max_tokens=12) for _ in range(4)]
            stream = await client.chat.completions.create(model=SERVED_MODEL, messages=ask("When was it built?"),
                                                          temperature=0, max_tokens=12, stream=True)
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            completion = await client.completions.create(model=SERVED_MODEL, prompt="The capital of France is",
                                                         temperature=0, max_tokens=4)
            async with httpx.AsyncClient(base_url=str(client.base_url).removesuffix("/v1/")) as http:
                flushed = await http.post("/flush_cache")          # fanned out to every replica
            again = await client.chat.completions.create(model=SERVED_MODEL, messages=ask("When was it built?"),
                                                         temperature=0, max_tokens=12)
    assert flushed.status_code == 200, flushed.text
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in plain         # type: ignore[union-attr]
              if r.usage and r.usage.prompt_tokens_details]
    assert any(cached), "the conversation's repeats found its prompt cached"
    details = again.usage.prompt_tokens_details if again.usage else None
    assert not (details and details.cached_tokens), "after the flush, nothing of the prompt is cached"
    texts = {r.choices[0].message.content for r in [*plain, again]}
    assert len(texts) == 1 and streamed in texts and next(iter(texts))        # greedy: one answer, wherever
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    for replica in replicas:
        assert not [k for k in replica.responses if k[2] == 404], replica.responses
    served = [r.count("/v1/chat/completions", 200) for r in replicas]
    assert sum(served) == 6
    if policy == "round_robin":
        assert all(served)
    if policy == "cache_aware":
        # Every request was rendered on each replica first; the repeats of one conversation stay on one.
        assert all(r.count("/v1/chat/completions/render", 200) >= 6 for r in replicas)
        assert sorted(served) == [0, 6]


def series(text: str) -> dict[str, float]:
    """name{labels} -> value, for every sample of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def test_replicas_expose_the_same_series_and_vllms_names(make_daemon: MakeDaemon) -> None:
    """What routers and endpoint pickers read: each replica of one configuration has the same label sets from
    its first scrape (routers that merge replicas' metrics refuse others), and vLLM's names carry forge's values
    with the served model's name."""
    with anyio.fail_after(HANG_GUARD_S):
        async with AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(running_daemon(make_daemon(speculative="ngram")))
                    for _ in range(2)]
            async with httpx.AsyncClient() as http:
                fresh = [series((await http.get(u + "/metrics")).text) for u in urls]
                # ignore_eos: five tokens whatever is sampled (an early end of text would make it fewer)
                body = {"model": SERVED_MODEL, "prompt": "The capital of France is", "max_tokens": 5,
                        "ignore_eos": True}
                done = await http.post(urls[0] + "/v1/completions", json=body)
                assert done.status_code == 200
                used = series((await http.get(urls[0] + "/metrics")).text)
    assert set(fresh[0]) == set(fresh[1])
    for label in ('finished_reason="stop"', '{reason="overload"}', 'phase="decode"', 'position="0"'):
        assert any(label in key for key in fresh[0]), label
    name = f'model_name="{SERVED_MODEL}"'
    for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f"{gauge}{{{name}}}" in fresh[0], gauge
    assert any(k.startswith("vllm:cache_config_info{") and 'block_size="' in k for k in fresh[0])
    assert used[f"vllm:generation_tokens_total{{{name}}}"] == used[f"forge:generation_tokens_total{{{name}}}"] == 5
    assert used[f'vllm:request_success_total{{finished_reason="length",{name}}}'] == 1
    # every series of the model's names it; the gateway's rejections and the model set's counts are the daemon's
    daemons = ("forge:request_rejected", "forge:model_swaps", "forge:model_loads")
    assert all(name in key for key in used if key.startswith("forge:") and not key.startswith(daemons))
    assert used[f"vllm:time_to_first_token_seconds_count{{{name}}}"] == 1
