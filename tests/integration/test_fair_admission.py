"""Fair admission through the real daemon: a request of many choices (embedding inputs, prompts x n) is
admitted as one unit and fed to the engine a window at a time, so a neighbour's requests are all
served beside it (none 503), its outputs are those of its inputs sent one by one, in order; a client
that leaves frees everything at once; and a request that could never be admitted is a 400 naming the
limit, not a 503 its client would retry for ever.

Every daemon here has --max-waiting 8: a window of 2 choices (a quarter of the queue).
"""

from __future__ import annotations

import anyio
import httpx
import numpy as np

from actors.supervisor import Daemon, running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    completion_text,
    data_payloads,
    is_idle,
    sample,
    wait_idle,
    wait_until,
)

MAX_WAITING = 8
WINDOW = MAX_WAITING // 4
TOPICS = ["cats", "rain", "markets", "trains", "bread", "chess", "rivers", "stars"]
INPUTS = [f"Sentence {i} is about {TOPICS[i % len(TOPICS)]}." for i in range(48)]
PROMPTS = ["The capital of France is", "Once upon a time", "The best way to cook rice is", "In 1969,"]


def queued(daemon: Daemon) -> float:
    """Prompt tokens the scheduler has taken in so far."""
    return sample(daemon, "forge:prompt_tokens_total")


class Neighbour:
    """Sends `body` to `path` one request after another until `done` is set (at least once), keeping the
    statuses, and notes the most requests seen waiting in the scheduler meanwhile."""

    def __init__(self, daemon: Daemon, http: httpx.AsyncClient, path: str, body: dict[str, object]) -> None:
        self.daemon, self.http, self.path, self.body = daemon, http, path, body
        self.statuses: list[int] = []
        self.max_waiting_seen = 0
        self.done = anyio.Event()

    async def run(self) -> None:
        while not self.statuses or not self.done.is_set():
            resp = await self.http.post(self.path, json=self.body)
            self.statuses.append(resp.status_code)

    async def watch(self) -> None:
        scheduler = self.daemon.scheduler
        assert scheduler is not None
        while not self.done.is_set():
            self.max_waiting_seen = max(self.max_waiting_seen, scheduler.statistics().num_waiting)
            await anyio.sleep(0.002)


async def test_a_big_embeddings_request_leaves_the_queue_to_a_neighbour(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"max_waiting": MAX_WAITING})
    completion = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            neighbour = Neighbour(daemon, http, "/v1/completions", completion)
            big: list[httpx.Response] = []

            async def embed_all() -> None:
                big.append(await http.post("/v1/embeddings", json={"input": INPUTS}))
                neighbour.done.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(neighbour.watch)
                tg.start_soon(embed_all)
                await wait_until(lambda: queued(daemon) > 0)       # the big request is in the engine
                tg.start_soon(neighbour.run)
            await wait_until(lambda: is_idle(daemon))
            alone = [(await http.post("/v1/embeddings", json={"input": text})).json() for text in INPUTS]
    assert neighbour.statuses and set(neighbour.statuses) == {200}, neighbour.statuses
    # The big request never had more than its window in the engine (the neighbour one more).
    assert neighbour.max_waiting_seen <= WINDOW + 1, neighbour.max_waiting_seen
    [resp] = big
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [d["index"] for d in body["data"]] == list(range(len(INPUTS)))
    for got, one in zip(body["data"], alone, strict=True):
        np.testing.assert_allclose(got["embedding"], one["data"][0]["embedding"], atol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(one["usage"]["prompt_tokens"] for one in alone)


async def test_a_streamed_completion_of_many_prompts_leaves_the_queue_to_a_neighbour(make_daemon: MakeDaemon) -> None:
    """prompts x n = --max-waiting choices, one running at a time: all but one would wait at once."""
    daemon = make_daemon(max_num_seqs=1, gateway={"max_waiting": MAX_WAITING})
    n = MAX_WAITING // len(PROMPTS)
    request = {"prompt": PROMPTS, "n": n, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            alone = [(await http.post("/v1/completions", json={**request, "prompt": p, "n": 1})).json()
                     for p in PROMPTS]
            neighbour = Neighbour(daemon, http, "/v1/completions", {"prompt": "Hello", "n": 2, "max_tokens": 2})
            raw: list[bytes] = []

            async def stream_all() -> None:
                async with http.stream("POST", "/v1/completions", json={**request, "stream": True}) as resp:
                    assert resp.status_code == 200
                    raw.append(b"".join([chunk async for chunk in resp.aiter_bytes()]))
                neighbour.done.set()

            start = queued(daemon)
            async with anyio.create_task_group() as tg:
                tg.start_soon(neighbour.watch)
                tg.start_soon(stream_all)
                await wait_until(lambda: queued(daemon) > start)
                tg.start_soon(neighbour.run)
            await wait_until(lambda: is_idle(daemon))
    assert neighbour.statuses and set(neighbour.statuses) == {200}, neighbour.statuses
    assert neighbour.max_waiting_seen <= WINDOW + 2, neighbour.max_waiting_seen
    payloads = data_payloads(raw[0])
    for k in range(len(PROMPTS) * n):
        assert completion_text(payloads, k) == alone[k // n]["choices"][0]["text"], k


async def test_a_client_that_leaves_a_big_request_frees_everything_and_sends_no_more(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"max_waiting": MAX_WAITING})
    inputs = INPUTS * 4
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            total = (await http.post("/v1/embeddings", json={"input": inputs[:len(INPUTS)]})).json()
            total_tokens = 4 * total["usage"]["prompt_tokens"]
            start = queued(daemon)
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: http.post("/v1/embeddings", json={"input": inputs}))
                await wait_until(lambda: queued(daemon) > start)
                tg.cancel_scope.cancel()                                   # the client leaves
            await wait_idle(daemon)
            tables = daemon.tracked()
            after = (await http.post("/v1/embeddings", json={"input": inputs[0]})).status_code
    assert set(tables.values()) == {0}, tables
    assert queued(daemon) - start < total_tokens / 2                       # the rest was never sent
    assert after == 200


async def test_a_request_that_could_never_be_admitted_is_a_400_naming_the_limit(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"max_waiting": MAX_WAITING, "max_queued_tokens": 256})
    too_many = {"model": SERVED_MODEL, "prompt": PROMPTS + ["One more"], "n": 2, "max_tokens": 2}
    too_long = {"model": SERVED_MODEL, "prompt": "word " * 300, "max_tokens": 2}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            many = await http.post("/v1/completions", json=too_many)
            many_chat = await http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 2})
            long = await http.post("/v1/completions", json=too_long)
            fits = await http.post("/v1/completions", json={**too_many, "prompt": PROMPTS})
            await wait_until(lambda: is_idle(daemon))
    err = assert_error(many, 400, code="too_many_choices")
    assert "10" in err["message"] and "--max-waiting" in err["message"] and str(MAX_WAITING) in err["message"]
    assert "retry-after" not in many.headers
    assert many_chat.status_code == 200, many_chat.text                    # n 8: as many as the queue holds
    err = assert_error(long, 400, code="request_too_large")
    assert "--max-queued-tokens" in err["message"] and "256" in err["message"]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2 * len(PROMPTS)


async def test_a_choice_of_a_later_window_refused_fails_the_response_as_a_first_one_would(
        make_daemon: MakeDaemon) -> None:
    """Past the 1,024-token context: refused by the engine once its window comes (a guard of the late path)."""
    daemon = make_daemon(gateway={"max_waiting": MAX_WAITING})
    too_long = " apple" * 1100
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            first = await http.post("/v1/embeddings", json={"input": [too_long, *INPUTS[:9]]})
            later = await http.post("/v1/embeddings", json={"input": [*INPUTS[:9], too_long]})
            body = {"prompt": [*PROMPTS, too_long], "max_tokens": 2, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                status, raw = resp.status_code, b"".join([chunk async for chunk in resp.aiter_bytes()])
            await wait_idle(daemon)
            tables = daemon.tracked()
    assert_error(first, 400, param="input")
    assert later.json() == first.json()
    assert status == 200
    errors = [p["error"] for p in data_payloads(raw) if "error" in p]
    assert errors and errors[0]["type"] == "invalid_request_error" and errors[0]["param"] == "prompt", errors
    assert set(tables.values()) == {0}, tables
