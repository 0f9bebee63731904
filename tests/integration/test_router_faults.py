"""Replicas that go away behind the real vLLM router (`vllm-router`): each replica a `forge serve` process,
so that it can be stopped as systemd or Kubernetes stops it (SIGTERM) or die outright (SIGKILL).

A rolling restart under streaming load (each replica in turn drained with SIGTERM, then started again on
its port) completes every request: a draining replica answers new requests 503, which the router retries
on another, and finishes the streams it holds. A replica killed with SIGKILL is routed around: the router
retries the refused connection on the others and its circuit breaker takes the dead one out. The router's
settings these rely on are the ones docs/scaling.md gives (ROUTER_FAULT_FLAGS below).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import httpx
import openai

from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, free_port, wait_healthy, wait_router

REPO = Path(__file__).resolve().parents[2]
ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
# What docs/scaling.md recommends for failover: health checked each second, a refused or 503 answer
# retried on another worker at once, a worker's breaker open after 3 failures and tried again after 2 s.
ROUTER_FAULT_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                      "--retry-max-retries", "6", "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "500",
                      "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "2"]


@dataclass
class Replica:
    """One `forge serve` process on a fixed port, restartable there."""
    port: int
    log: Path
    model: Path
    proc: anyio.abc.Process | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        command = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{self.port}",
                   "--model", str(self.model), "--served-model-name", SERVED_MODEL, "--kv-cache-memory", "128MiB",
                   "--max-model-len", "1024", "--max-num-seqs", "4", "--blas-threads", "1", "--log-level", "warning"]
        self.starts += 1
        with self.log.open("ab") as out:
            self.proc = await anyio.open_process(command, stdout=out, stderr=out, cwd=REPO,
                                                 env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        async with httpx.AsyncClient(base_url=self.url) as http:
            await wait_healthy(http, self.proc, lambda: self.log.read_text()[-4000:], interval=0.2)

    async def stop(self, sig: signal.Signals) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        code = await self.proc.wait()
        self.proc = None
        return code


@dataclass
class Load:
    """Streaming clients looping through the router until told to stop, every outcome kept."""
    client: openai.AsyncOpenAI
    stop: anyio.Event = field(default_factory=anyio.Event)
    finished: list[str] = field(default_factory=list)           # each stream's finish_reason
    failures: list[str] = field(default_factory=list)

    async def client_loop(self, index: int) -> None:
        while not self.stop.is_set():
            try:
                stream = await self.client.chat.completions.create(
                    model=SERVED_MODEL, temperature=0, max_tokens=16, stream=True,
                    messages=[{"role": "user", "content": f"Name a colour, client {index}."}])
                reasons = [c.choices[0].finish_reason async for c in stream if c.choices and c.choices[0].finish_reason]
                self.finished.append(reasons[-1] if reasons else "none")
            except openai.APIError as e:
                self.failures.append(f"{type(e).__name__}: {e}")


@asynccontextmanager
async def routed(replicas: list[Replica]) -> AsyncIterator[openai.AsyncOpenAI]:
    assert ROUTER is not None, "vllm-router is a test dependency: pip install -e '.[test]'"
    port = free_port()
    router = await anyio.open_process(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[r.url for r in replicas],
         "--policy", "round_robin", "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port()),
         "--log-level", "warning", *ROUTER_FAULT_FLAGS], stdout=None, stderr=None)
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_router(base)
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                      timeout=HANG_GUARD_S) as client:
            yield client
    finally:
        router.terminate()
        await router.wait()


@asynccontextmanager
async def replicas_of(count: int, tmp_path: Path, model: Path) -> AsyncIterator[list[Replica]]:
    replicas = [Replica(free_port(), tmp_path / f"replica-{i}.log", model) for i in range(count)]
    async with AsyncExitStack() as stack:
        for r in replicas:
            stack.push_async_callback(_kill, r)
        async with anyio.create_task_group() as tg:              # start them side by side
            for r in replicas:
                tg.start_soon(r.start)
        yield replicas


async def _kill(replica: Replica) -> None:
    if replica.proc is not None and replica.proc.returncode is None:
        replica.proc.kill()
        await replica.proc.wait()


async def test_a_rolling_restart_under_streaming_load_loses_no_request(tmp_path: Path,
                                                                      default_model_path: Path) -> None:
    with anyio.fail_after(6 * HANG_GUARD_S):
        async with replicas_of(3, tmp_path, default_model_path) as replicas, routed(replicas) as client:
            load = Load(client)
            exit_codes = []
            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(load.client_loop, i)
                while len(load.finished) < 4:                  # the load is flowing before the first stop
                    await anyio.sleep(0.1)
                for replica in replicas:
                    before = len(load.finished)
                    exit_codes.append(await replica.stop(signal.SIGTERM))
                    await replica.start()
                    while len(load.finished) < before + 4:     # served on before the next one stops
                        await anyio.sleep(0.1)
                load.stop.set()
    assert exit_codes == [0, 0, 0], "each replica drained and exited 0"
    assert not load.failures, load.failures[:5]
    assert len(load.finished) >= 16 and set(load.finished) <= {"stop", "length"}, load.finished


async def test_a_replica_killed_outright_is_routed_around(tmp_path: Path, default_model_path: Path) -> None:
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with replicas_of(2, tmp_path, default_model_path) as replicas, routed(replicas) as client:
            await replicas[0].stop(signal.SIGKILL)
            answers = []
            for i in range(8):                     # round robin would send half of these to the dead one
                reply = await client.chat.completions.create(
                    model=SERVED_MODEL, temperature=0, max_tokens=8,
                    messages=[{"role": "user", "content": f"Count to {i + 2}."}])
                answers.append(reply.choices[0].finish_reason)
            async with httpx.AsyncClient(base_url=replicas[1].url) as http:
                served = (await http.get("/metrics")).text
    assert answers == answers[:1] * 8 and answers[0] in ("stop", "length"), answers
    done = sum(float(line.rpartition(" ")[2]) for line in served.splitlines()
               if line.startswith("forge:request_success_total{"))
    assert done == 8, "the survivor served every request"


async def test_a_stream_cut_by_a_killed_replica_ends_in_an_error_the_client_sees(
        tmp_path: Path, default_model_path: Path) -> None:
    """Nothing of a dead process can write the SSE error event: what matters is that the cut is not
    mistaken for a finished answer. Through the router the client's stream ends without a finish_reason
    and raises; the next request is served by the survivor."""
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with replicas_of(2, tmp_path, default_model_path) as replicas, routed(replicas) as client:
            stream = await client.chat.completions.create(
                model=SERVED_MODEL, temperature=0, max_tokens=400, stream=True, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "Tell a very long story about clocks."}])
            pieces, reasons, error = 0, [], None
            try:
                async for chunk in stream:
                    if chunk.choices:
                        pieces += 1
                        reasons.append(chunk.choices[0].finish_reason)
                        if pieces == 5:                     # mid-stream: kill whichever replica holds it
                            for r in replicas:
                                async with httpx.AsyncClient(base_url=r.url) as http:
                                    running = [line for line in (await http.get("/metrics")).text.splitlines()
                                               if line.startswith("forge:num_requests_running{")]
                                if running and float(running[0].split()[-1]) > 0:
                                    await r.stop(signal.SIGKILL)
            except Exception as e:    # the transport's error: openai's client carries its own httpx
                error = e
            after = await client.chat.completions.create(
                model=SERVED_MODEL, temperature=0, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert sum(r.proc is None for r in replicas) == 1, "one replica held the stream and was killed"
    assert pieces < 400 and not any(reasons), "the cut stream never looked finished"
    assert error is not None and ("ProtocolError" in type(error).__name__ or isinstance(error, openai.APIError)), \
        f"the client's stream raised at the cut: {error!r}"
    assert after.choices[0].finish_reason in ("stop", "length")
