"""Many clients at once: a storm of 200 that leave at random points, and a burst of ten times the
admission bound. Afterwards nothing is held for any of them; every accepted request completed."""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx

from actors.supervisor import running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    is_idle,
    sample,
    wait_until,
)

NUM_CLIENTS = 200


async def test_a_storm_of_200_clients_leaving_at_random_points_leaves_nothing_behind(
        make_daemon: MakeDaemon) -> None:
    """Streamed and plain, completions and chat; each client leaves at its own point: at once (its
    request queued), after a random wait (queued, prefilling or decoding), after its first frame,
    after a few frames, or part-way through a frame. Every block is free afterwards, no handler is
    left, and every per-request table in every actor is empty."""
    daemon = make_daemon(max_num_seqs=8, max_num_batched_tokens=128)
    rng = random.Random(20261201)
    left = {"at once": 0, "after a wait": 0, "after the first frame": 0, "after some frames": 0, "mid-frame": 0,
            "completed": 0}
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None,
                                                                    limits=httpx.Limits(max_connections=None)) as http:
            async def client(i: int) -> None:
                chat = i % 3 == 0
                body: dict[str, Any] = {"model": SERVED_MODEL, "max_tokens": rng.choice([8, 64, 300]),
                                        "ignore_eos": True, "stream": i % 2 == 0}
                if chat:
                    body["messages"] = [{"role": "user", "content": f"Tell me about river number {i}."}]
                else:
                    body["prompt"] = f"{PROMPT} {i} " + "and more " * rng.randint(0, 150)
                path = "/v1/chat/completions" if chat else "/v1/completions"
                how = rng.choice(["at once", "after a wait", "after the first frame", "after some frames",
                                  "mid-frame"])
                wait = rng.uniform(0, 3)
                with anyio.CancelScope() as scope:
                    if how == "at once":
                        with anyio.move_on_after(0.001):
                            await http.post(path, json=body)
                        left[how] += 1
                        return
                    if how == "after a wait" or not body["stream"]:
                        with anyio.move_on_after(wait):
                            await http.post(path, json=body)
                            left["completed"] += 1
                            return
                        left["after a wait"] += 1
                        return
                    frames, stop_after = 0, 1 if how == "after the first frame" else rng.randint(2, 12)
                    async with http.stream("POST", path, json=body) as resp:
                        async for chunk in resp.aiter_raw():
                            if how == "mid-frame" and b"data: {" in chunk and len(chunk) > 8:
                                left[how] += 1              # read part of a frame, then go
                                scope.cancel()
                            frames += chunk.count(b"\n\n")
                            if how != "mid-frame" and frames >= stop_after:
                                left[how] += 1
                                return
                    left["completed"] += 1

            async with anyio.create_task_group() as tg:
                for i in range(NUM_CLIENTS):
                    tg.start_soon(client, i)
            await wait_until(lambda: is_idle(daemon))
            tables = daemon.tracked()
            ok = await http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                          "ignore_eos": True})
    assert sum(left.values()) == NUM_CLIENTS
    assert min(left[k] for k in left if k != "completed") >= 10, left
    assert set(tables.values()) == {0}, tables
    assert sum(sample(daemon, "forge:request_aborted_total", {"phase": p}) for p in ("queued", "prefill",
                                                                                     "decode")) >= 100
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


async def test_a_burst_of_ten_times_the_admission_bound_is_refused_quickly_and_the_rest_complete(
        make_daemon: MakeDaemon) -> None:
    bound = 16
    daemon = make_daemon(max_num_seqs=4, gateway={"max_waiting": bound, "retry_after_s": 3})
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
    responses: list[httpx.Response] = []
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None,
                                                                    limits=httpx.Limits(max_connections=None)) as http:
            async def send() -> None:
                responses.append(await http.post("/v1/completions", json=body))

            async with anyio.create_task_group() as tg:
                for _ in range(10 * bound):
                    tg.start_soon(send)
            await wait_until(lambda: is_idle(daemon))
            tables = daemon.tracked()
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(accepted) + len(refused) == 10 * bound
    assert len(accepted) >= bound and len(refused) >= 5 * bound, (len(accepted), len(refused))
    for resp in accepted:
        assert resp.json()["usage"]["completion_tokens"] == 6
    for resp in refused:
        assert_error(resp, 503, code="overloaded")
        assert resp.headers["retry-after"] == "3"
    assert sample(daemon, "forge:request_rejected_total", {"reason": "overload"}) == len(refused)
    assert set(tables.values()) == {0}, tables
