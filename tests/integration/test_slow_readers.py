"""A client that stops reading its stream: past --max-unsent-tokens waiting for it, its response is ended
and its sequence leaves the engine at once (blocks freed, counted, logged), while a neighbour stream runs
on unharmed; the client that reads again finds an error event in the route's envelope and the stream's end,
and once it leaves nothing of it is kept.

The daemon's send buffers are made small (running_daemon's send_buffer), so the client's stall blocks the
daemon's writes after a few KiB instead of the megabytes the kernel would otherwise take first; the client's
receive buffer is small too, and it never reads until the test says so.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import h11
import httpx
import pytest

from actors.supervisor import Daemon, running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    completion_text,
    data_payloads,
    is_idle,
    sample,
    wait_until,
)

MAX_UNSENT = 64                       # tokens a response may have waiting (the daemon's --max-unsent-tokens)
BUFFER = 4096                         # bytes of each socket buffer, the daemon's send and the client's receive
SLOW_TOKENS, NEIGHBOUR_TOKENS = 900, 40
# ~2.5 KiB of SSE per token (20 alternatives each): the buffers fill within a few dozen tokens.
SLOW = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": SLOW_TOKENS, "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}
NEIGHBOUR = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": NEIGHBOUR_TOKENS, "ignore_eos": True,
             "temperature": 0, "stream": True}


@asynccontextmanager
async def stalled_client(port: int, body: dict[str, Any]) -> AsyncIterator[tuple[socket.socket, h11.Connection]]:
    """A connection that sends `body` as a POST to /v1/chat/completions and then reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)    # before connecting: the window it offers
    conn = h11.Connection(h11.CLIENT)
    payload = json.dumps(body).encode()
    request = h11.Request(method="POST", target="/v1/chat/completions",
                          headers=[("Host", "127.0.0.1"), ("Content-Type", "application/json"),
                                   ("Content-Length", str(len(payload)))])
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        sock.setblocking(False)
        yield sock, conn
    finally:
        sock.close()


async def read_response(sock: socket.socket, conn: h11.Connection) -> tuple[int, bytes]:
    """Read the response to its end: its status and body."""
    status, body = 0, b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            await anyio.wait_readable(sock)
            conn.receive_data(sock.recv(1 << 16))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return status, body
        else:
            raise AssertionError(f"unexpected {event!r}")


def engine_is_idle(daemon: Daemon) -> bool:
    """Nothing running or waiting, every block free, no actor keeping a request: the gateway may still hold
    the response of a client that has not left (its connection, its group in the stream demultiplexer)."""
    assert daemon.scheduler is not None and daemon.allocator is not None
    stats, cache = daemon.scheduler.statistics(), daemon.allocator.statistics()
    engine = {k: v for k, v in daemon.tracked().items() if not k.startswith(("gateway.", "demux."))}
    return (stats.num_running == stats.num_waiting == 0 and cache.num_free_blocks == cache.num_total_blocks
            and set(engine.values()) == {0})


async def neighbour(http: httpx.AsyncClient) -> str:
    resp = await http.post("/v1/completions", json=NEIGHBOUR)
    assert resp.status_code == 200, resp.text
    return completion_text(data_payloads(resp.content))


@pytest.mark.parametrize("reads_again", [True, False], ids=["reads-again", "leaves"])
async def test_a_client_that_stops_reading_is_cut_off_and_its_neighbour_is_unharmed(
        make_daemon: MakeDaemon, reads_again: bool) -> None:
    daemon = make_daemon(gateway={"max_unsent_tokens": MAX_UNSENT})
    texts: list[str] = []
    with anyio.fail_after(HANG_GUARD_S):
        async with (running_daemon(daemon, send_buffer=BUFFER) as url,
                    httpx.AsyncClient(base_url=url, timeout=None) as http):
            alone = await neighbour(http)
            port = int(url.rsplit(":", 1)[1])
            async with stalled_client(port, SLOW) as (sock, conn):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: _append(texts, neighbour(http)))
                    await wait_until(lambda: sample(daemon, "forge:slow_reader_aborts_total") == 1)
                # Cut off while its client still holds the connection: the engine has let it go.
                await wait_until(lambda: engine_is_idle(daemon))
                slow_tokens = sample(daemon, "forge:generation_tokens_total") - 2 * NEIGHBOUR_TOKENS
                assert slow_tokens < SLOW_TOKENS                         # it never ran to its max_tokens
                if reads_again:
                    status, raw = await read_response(sock, conn)
            await wait_until(lambda: is_idle(daemon))                    # the client gone: nothing kept
            tables = daemon.tracked()
            page = (await http.get("/metrics")).text
    assert texts == [alone]
    assert set(tables.values()) == {0}, tables
    assert 'forge:slow_reader_aborts_total{model_name="forge-test"} 1.0' in page
    if reads_again:
        assert status == 200
        payloads = data_payloads(raw)                                    # ends with [DONE]
        error = payloads[-1]["error"]
        assert error["code"] == "slow_reader" and str(MAX_UNSENT) in error["message"], error
        assert all("choices" in p for p in payloads[:-1])                # what was sent before, then the error


async def _append(out: list[str], text: Any) -> None:
    out.append(await text)
