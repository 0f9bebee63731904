"""forge's KV events through the real vLLM router (`vllm-router`, a test dependency): three replicas with
--kv-events publish their prefix caches' blocks, and the router's kv_aware policy, subscribed to them
(--kv-event-source per replica), sends each conversation's next turn to the replica that holds its prefix.

Each conversation's first turn is sent to one replica directly, past the router: only forge's events can
tell the router where it is cached. A subscriber of the test's own, on the same PUB sockets, witnesses that
the events were sent before the next turn goes through the router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import zmq

from actors.http.gateway import GatewayConfig
from actors.runtime.kv_publisher import KvEventsConfig
from actors.supervisor import DaemonConfig, running_daemon
from forge.engine.kv_events import BlockStored, decode_batch
from forge.models.loading import LoadedModel
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, engine_config, free_port, sample, wait_router
from tests.integration.test_vllm_router import ROUTER, Recording

SYSTEM = ("You are the guide of a small observatory on a hill. Answer in one short sentence, and say so when "
          "you do not know. The observatory has two telescopes and opens on clear nights. ") * 2
QUESTIONS = ["What can I see tonight?", "Is it open when it rains?"]


def conversation(topic: int, num_turns: int) -> list[Any]:
    messages: list[Any] = [{"role": "system", "content": f"Visitor number {topic}. {SYSTEM}"}]
    for turn in QUESTIONS[:num_turns]:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "Let me look."}]
    return messages[:-1]


def endpoint_of(replica: Recording) -> str:
    assert replica.kv_publisher is not None
    return replica.kv_publisher.bound_endpoint


@asynccontextmanager
async def kv_fleet(loaded: LoadedModel, default_model_path: Path, log: Path, num: int = 3
                   ) -> AsyncIterator[tuple[list[Recording], list[str], openai.AsyncOpenAI]]:
    assert ROUTER is not None, "vllm-router is a test dependency: pip install -e '.[test]'"
    async with AsyncExitStack() as stack:
        configs = [DaemonConfig(engine=engine_config(max_num_seqs=4), model=str(default_model_path),
                                gateway=GatewayConfig(served_model_name=SERVED_MODEL),
                                kv_events=KvEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}"))
                   for _ in range(num)]
        replicas = [Recording(c, loaded) for c in configs]
        urls = [await stack.enter_async_context(running_daemon(r)) for r in replicas]
        sources = [a for r, u in zip(replicas, urls, strict=True)
                   for a in ("--kv-event-source", f"{u}={endpoint_of(r)}")]
        port = free_port()
        with log.open("wb") as out:
            router = await anyio.open_process(
                [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "kv_aware",
                 "--kv-event-model", SERVED_MODEL, "--kv-event-block-size", "16", *sources,
                 "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port()),
                 "--log-level", "debug"], stdout=out, stderr=out)
        try:
            base = f"http://127.0.0.1:{port}"
            await wait_router(base)
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                          timeout=HANG_GUARD_S) as client:
                yield replicas, urls, client
        finally:
            router.terminate()
            await router.wait()


async def wait_stored(sub: zmq.Socket[bytes]) -> int:
    """Receive batches until one holds a BlockStored event; how many blocks it named."""
    while True:
        if sub.poll(0):
            _topic, _seq, payload = sub.recv_multipart()
            stored = [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
            if stored:
                return sum(len(e.block_hashes) for e in stored)
        await anyio.sleep(0.05)


async def test_kv_aware_sends_each_turn_to_the_replica_holding_its_prefix(
        loaded: LoadedModel, default_model_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    ctx = zmq.Context.instance()
    with anyio.fail_after(3 * HANG_GUARD_S):
        async with kv_fleet(loaded, default_model_path, log) as (replicas, urls, client):
            subs = []
            for replica in replicas:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint_of(replica))
                subs.append(sub)
            try:
                async with httpx.AsyncClient(timeout=HANG_GUARD_S) as http:
                    for replica, url in zip(replicas, urls, strict=True):    # what vLLM's route answers
                        [source] = (await http.get(url + "/kv_event_sources")).json()["sources"]
                        assert source == {"data_parallel_rank": 0, "endpoint": endpoint_of(replica),
                                          "replay_endpoint": None, "topic": ""}
                    for topic, url in enumerate(urls):                    # conversation i cached on replica i
                        body = {"model": SERVED_MODEL, "messages": conversation(topic, 1), "max_tokens": 4,
                                "temperature": 0}
                        assert (await http.post(url + "/v1/chat/completions", json=body)).status_code == 200
                        assert await wait_stored(subs[topic]) >= 4
                served, cached = [], []
                for topic in range(len(replicas)):
                    before = [r.count("/v1/chat/completions", 200) for r in replicas]
                    reply = await client.chat.completions.create(model=SERVED_MODEL, messages=conversation(topic, 2),
                                                                 temperature=0, max_tokens=4)
                    after = [r.count("/v1/chat/completions", 200) for r in replicas]
                    served.append([i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b])
                    details = reply.usage.prompt_tokens_details if reply.usage else None
                    cached.append(details.cached_tokens if details else 0)
            finally:
                for sub in subs:
                    sub.close(linger=0)
    assert served == [[0], [1], [2]], (served, log.read_text()[-4000:])
    assert all(n and n >= 64 for n in cached), cached                    # the system prompt's blocks hit
    for replica in replicas:
        assert not [k for k in replica.responses if k[2] == 404], replica.responses
        assert replica.kv_publisher is not None and replica.kv_publisher.statistics().num_dropped == 0
    for replica in replicas:
        replica.metrics.render()                                        # a scrape brings the counters up to date
    published = [sample(r, "forge:kv_events_published_total") for r in replicas]
    assert all(published) and not any(sample(r, "forge:kv_events_dropped_total") for r in replicas)
