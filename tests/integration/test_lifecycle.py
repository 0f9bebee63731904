"""Request and process lifetimes: disconnects in every phase free everything, overload gets 503,
and SIGTERM drains a real `forge serve` process (running streams finish, new requests get 503)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import TaskGroup

from actors.supervisor import Daemon, running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    data_payloads,
    free_port,
    generated_tokens,
    long_prompt,
    wait_healthy,
    wait_idle,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]


class Client:
    """One request in its own task, cancellable at any moment (the client goes away)."""

    def __init__(self, tg: TaskGroup, http: httpx.AsyncClient, body: dict[str, Any], *, stream: bool) -> None:
        self.first_frame = anyio.Event()
        self.done = anyio.Event()
        self.status: int | None = None
        self.raw = b""
        self._scope = anyio.CancelScope()
        tg.start_soon(self._run, http, {"model": SERVED_MODEL, **body, "stream": stream})

    async def _run(self, http: httpx.AsyncClient, body: dict[str, Any]) -> None:
        with self._scope:
            if body["stream"]:
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    self.status = resp.status_code
                    async for chunk in resp.aiter_raw():
                        self.raw += chunk
                        if b"data: {" in self.raw:
                            self.first_frame.set()
            else:
                resp = await http.post("/v1/completions", json=body)
                self.status, self.raw = resp.status_code, resp.content
            self.done.set()                           # only when the response was read to its end

    def disconnect(self) -> None:
        self._scope.cancel()


def _stats(daemon: Daemon) -> tuple[int, int]:
    assert daemon.scheduler is not None
    stats = daemon.scheduler.statistics()
    return stats.num_running, stats.num_waiting


LONG = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}       # runs far longer than any test


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_disconnect_while_queued(make_daemon: MakeDaemon, stream: bool) -> None:
    daemon = make_daemon(max_num_seqs=1)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            async with anyio.create_task_group() as tg:
                running = Client(tg, http, LONG, stream=True)
                await running.first_frame.wait()
                queued = Client(tg, http, LONG, stream=stream)
                await wait_until(lambda: _stats(daemon) == (1, 1))
                queued.disconnect()
                await wait_until(lambda: _stats(daemon)[1] == 0)
                assert _stats(daemon) == (1, 0)          # dropped from the queue; the first still runs
                running.disconnect()
            await wait_idle(daemon, max_generated=generated_tokens(daemon) + 32)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_disconnect_during_prefill(make_daemon: MakeDaemon, stream: bool) -> None:
    # ~600 prompt tokens in chunks of 32: the prefill spans many steps, none of which samples.
    daemon = make_daemon(max_num_batched_tokens=32)
    body = {"prompt": long_prompt(300), "max_tokens": 200, "ignore_eos": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            allocator = daemon.allocator
            assert allocator is not None
            async with anyio.create_task_group() as tg:
                client = Client(tg, http, body, stream=stream)
                await wait_until(lambda: allocator.statistics().num_free_blocks
                                 < allocator.statistics().num_total_blocks)   # the prefill has begun
                assert generated_tokens(daemon) == 0 and not client.first_frame.is_set()
                client.disconnect()
            await wait_idle(daemon, max_generated=16)
    assert client.status in (None, 200) and not client.first_frame.is_set()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
async def test_disconnect_while_decoding(make_daemon: MakeDaemon, stream: bool) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            async with anyio.create_task_group() as tg:
                client = Client(tg, http, LONG, stream=stream)
                if stream:
                    await client.first_frame.wait()
                else:
                    await wait_until(lambda: generated_tokens(daemon) >= 2)
                assert _stats(daemon) == (1, 0)
                client.disconnect()
            await wait_idle(daemon, max_generated=generated_tokens(daemon) + 32)
    assert not client.done.is_set()


async def test_overload_gets_503_with_retry_after(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(max_num_seqs=1, gateway={"max_waiting": 1, "retry_after_s": 7})
    burst = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2}
    responses: list[httpx.Response] = []
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=None) as http:
            async with anyio.create_task_group() as tg:
                # The one running slot is taken for the whole burst; one more request may wait.
                running = Client(tg, http, {"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True},
                                 stream=True)
                await running.first_frame.wait()

                async def send() -> None:
                    responses.append(await http.post("/v1/completions", json=burst))

                async with anyio.create_task_group() as burst_tg:
                    for _ in range(4):
                        burst_tg.start_soon(send)
            await wait_idle(daemon)
    assert running.status == 200 and data_payloads(running.raw)[-1]["choices"][0]["finish_reason"] == "length"
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(accepted) == 1 and len(refused) == 3, [r.status_code for r in responses]
    assert accepted[0].json()["usage"]["completion_tokens"] == 2
    for resp in refused:
        assert_error(resp, 503, code="overloaded")
        assert resp.headers["retry-after"] == "7"


async def test_sigterm_drains_then_exits_0(tmp_path: Path, default_model_path: Path) -> None:
    port = free_port()
    log = tmp_path / "forge.log"
    command = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}",
               "--model", str(default_model_path),
               "--served-model-name", SERVED_MODEL, "--kv-cache-memory", "256MiB", "--max-model-len", "1024",
               "--blas-threads", "1", "--log-format", "json"]
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}
    with anyio.fail_after(HANG_GUARD_S), log.open("wb") as log_file:
        proc = await anyio.open_process(command, stdout=log_file, stderr=log_file, cwd=REPO,
                                        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        try:
            async with proc, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None) as http:
                await wait_healthy(http, proc, lambda: log.read_text()[-4000:], interval=0.2)
                async with anyio.create_task_group() as tg:
                    running = Client(tg, http, body, stream=True)
                    await running.first_frame.wait()
                    proc.send_signal(signal.SIGTERM)
                    while (health := await http.get("/healthz")).status_code == 200:
                        await anyio.sleep(0.02)
                    refused = await http.post("/v1/completions", json={**body, "max_tokens": 2})
                    assert not running.done.is_set()          # still streaming while draining
                exit_code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert_error(refused, 503, code="draining")
    assert "retry-after" in refused.headers
    assert running.status == 200
    payloads = data_payloads(running.raw)                      # ends with [DONE]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(p["choices"][0]["text"]) > 0 for p in payloads) > 1
    assert exit_code == 0, log.read_text()[-4000:]
    assert "Traceback" not in log.read_text()


async def test_when_the_drain_timeout_expires_running_responses_end_with_an_error_never_cut(
        make_daemon: MakeDaemon) -> None:
    """A stream still running at the drain timeout ends with an error event and [DONE]; a response
    whose body is not sent yet gets a 503 envelope (code "shutdown": send it again). Nothing is cut."""
    daemon = make_daemon(drain_timeout=0.5, max_num_seqs=4)
    endless = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}      # would outlive the drain
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            async with anyio.create_task_group() as tg:
                streamed = Client(tg, http, endless, stream=True)
                plain = Client(tg, http, endless, stream=False)
                await streamed.first_frame.wait()
                await wait_until(lambda: _stats(daemon)[0] == 2)
                daemon.request_drain()
                await streamed.done.wait()
                await plain.done.wait()
    assert streamed.status == 200
    payloads = data_payloads(streamed.raw)                  # asserts the framing: ends with [DONE]
    assert payloads[-1]["error"]["code"] == "shutdown" and payloads[-1]["error"]["type"] == "server_error"
    assert all("choices" in p for p in payloads[:-1])
    assert plain.status == 503
    error = json.loads(plain.raw)["error"]
    assert error["code"] == "shutdown" and error["type"] == "server_error" and error["message"]
