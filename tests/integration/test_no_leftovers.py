"""A daemon that runs for weeks keeps nothing for a request after it ends.

Many requests of every kind (plain and streamed, n > 1, several prompts, stop strings, logprobs,
rejected ones, clients that leave mid-stream) go through one daemon; afterwards every per-request
table in the gateway, the router and each actor is empty and every block is free.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, PROMPT, SERVED_MODEL, MakeDaemon, is_idle, wait_until

NUM_ROUNDS = 6


def bodies(i: int) -> list[tuple[str, dict[str, Any]]]:
    """One round of requests; i varies prompts so the prefix cache sees both hits and misses."""
    prompt = f"{PROMPT} (round {i})"
    return [
        ("/v1/completions", {"prompt": prompt, "max_tokens": 6}),
        ("/v1/completions", {"prompt": [prompt, "Once upon a time"], "max_tokens": 4, "n": 2, "stream": True}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 8, "stop": [" the", ","], "logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Say hi {i}"}], "max_tokens": 5,
                                  "n": 2, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a river"}], "max_tokens": 4,
                                  "temperature": 0.8, "seed": i}),
        ("/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4}),                    # rejected: bad id
        ("/v1/completions", {"prompt": "x " * 1200, "max_tokens": 4}),                   # rejected: too long
        ("/generate", {"prompt": prompt, "max_tokens": 3}),
    ]


async def test_every_per_request_table_is_empty_after_many_requests(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(max_num_seqs=4, max_num_batched_tokens=64)
    statuses: list[int] = []
    with anyio.fail_after(HANG_GUARD_S * 2):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            async def send(path: str, body: dict[str, Any]) -> None:
                resp = await http.post(path, json={"model": SERVED_MODEL, **body})
                statuses.append(resp.status_code)

            async def leave_mid_stream(i: int) -> None:
                body = {"model": SERVED_MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 200, "ignore_eos": True,
                        "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    async for chunk in resp.aiter_raw():
                        if b"data: {" in chunk:
                            return                                  # the client goes away

            for i in range(NUM_ROUNDS):
                async with anyio.create_task_group() as tg:
                    for path, body in bodies(i):
                        tg.start_soon(send, path, body)
                    tg.start_soon(leave_mid_stream, i)
            await wait_until(lambda: is_idle(daemon))
            tables = daemon.tracked()
    assert len(statuses) == NUM_ROUNDS * len(bodies(0))
    assert statuses.count(400) == 2 * NUM_ROUNDS and statuses.count(200) == 6 * NUM_ROUNDS, statuses
    assert len(tables) >= 15 and set(tables.values()) == {0}, tables
