"""Streaming through real nginx with deploy/nginx/forge.conf, and curl -N against the daemon.

nginx runs as a subprocess in the foreground, with the site config from deploy/ (its listen and
upstream lines rewritten to free loopback ports) inside a minimal nginx.conf in tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
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
    free_port,
    generated_tokens,
    wait_healthy,
    wait_idle,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "deploy" / "nginx" / "forge.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
CURL = shutil.which("curl")

needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/install-test-deps)")
needs_curl = pytest.mark.skipif(CURL is None, reason="curl is not installed (scripts/install-test-deps)")

MAIN_CONF = """\
{user}daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log notice;
events {{
    worker_connections 256;
}}
http {{
    access_log {dir}/access.log;
    client_body_temp_path {dir}/client_body_temp;
    proxy_temp_path {dir}/proxy_temp;
    fastcgi_temp_path {dir}/fastcgi_temp;
    uwsgi_temp_path {dir}/uwsgi_temp;
    scgi_temp_path {dir}/scgi_temp;
    include {dir}/forge.conf;
}}
"""


def site_config(listen_port: int, upstream_ports: int | list[int]) -> str:
    """deploy/nginx/forge.conf listening on a loopback port, proxying to the daemons' ports."""
    ports = [upstream_ports] if isinstance(upstream_ports, int) else upstream_ports
    text = SITE.read_text()
    text, num_listen = re.subn(r"(?m)^(\s*)listen\s+[^;]+;", rf"\g<1>listen 127.0.0.1:{listen_port};", text)
    servers = "\n".join(f"\\g<1>server 127.0.0.1:{port};" for port in ports)
    text, num_upstream = re.subn(r"(?m)^(\s*)server\s+127\.0\.0\.1:8080;", servers, text)
    assert num_listen == 1 and num_upstream == 1, "forge.conf no longer has one listen and one upstream line"
    return text


@asynccontextmanager
async def running_nginx(tmp_path: Path, upstream_port: int | list[int]) -> AsyncIterator[str]:
    """nginx in the foreground in front of the daemon(s); yields its base URL."""
    assert NGINX is not None
    port = free_port()
    (tmp_path / "forge.conf").write_text(site_config(port, upstream_port))
    user = "user root;\n" if os.geteuid() == 0 else ""       # workers must reach tmp_path
    (tmp_path / "nginx.conf").write_text(MAIN_CONF.format(user=user, dir=tmp_path))
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "nginx.stderr").open("wb") as stderr:
        proc = await anyio.open_process([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                                        stdout=stderr, stderr=stderr)
        async with proc:
            try:
                async with httpx.AsyncClient(base_url=url) as http:
                    error_log = tmp_path / "error.log"
                    def explain() -> str:
                        return error_log.read_text() if error_log.exists() else "nginx exited"

                    await wait_healthy(http, proc, explain, interval=0.05)
                yield url
            finally:
                if proc.returncode is None:
                    proc.send_signal(signal.SIGTERM)            # fast shutdown
                    with anyio.move_on_after(10):
                        await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


async def curl_stream(url: str, body: dict[str, object]) -> bytes:
    assert CURL is not None
    result = await anyio.run_process([CURL, "-sS", "-N", "--fail-with-body", "-X", "POST", url,
                                      "-H", "Content-Type: application/json", "-d", json.dumps(body)])
    return result.stdout


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@needs_curl
async def test_curl_streams_from_the_daemon(make_daemon: MakeDaemon) -> None:
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url:
            raw = await curl_stream(url + "/v1/completions", body)
    assert "Paris" in completion_text(data_payloads(raw))


@needs_nginx
@needs_curl
async def test_curl_streams_through_nginx(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    chat = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "stream": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(make_daemon()) as url, running_nginx(tmp_path, _port(url)) as proxy:
            direct = await curl_stream(url + "/v1/completions", body)
            proxied = await curl_stream(proxy + "/v1/completions", body)
            chat_raw = await curl_stream(proxy + "/v1/chat/completions", chat)
    direct_payloads, proxied_payloads = data_payloads(direct), data_payloads(proxied)
    assert "Paris" in completion_text(proxied_payloads)
    assert completion_text(proxied_payloads) == completion_text(direct_payloads)     # greedy: same frames
    assert len(proxied_payloads) == len(direct_payloads)
    assert proxied_payloads[-1]["choices"] == [] and proxied_payloads[-1]["usage"]["completion_tokens"] == 4
    chat_payloads = data_payloads(chat_raw)
    assert chat_payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat_payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def _first_frame_then_state(daemon: Daemon, proxy: str, body: dict[str, object]) -> tuple[int, str]:
    """Read up to the first content frame through the proxy, then look at the daemon: is the request
    still running? Leaving the block disconnects the client, mid-generation."""
    assert daemon.scheduler is not None
    async with httpx.AsyncClient(base_url=proxy, timeout=None) as http:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return daemon.scheduler.statistics().num_running, line
    raise AssertionError("the stream ended without a frame")


@needs_nginx
async def test_tokens_arrive_through_nginx_while_generating(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    # The whole stream (12 frames, ~2.5 KB) fits in one of nginx's proxy buffers, and generating it
    # takes many steps: a proxy that buffered it would pass the first frame on only once the
    # request had finished.
    daemon = make_daemon()
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "stream": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, running_nginx(tmp_path, _port(url)) as proxy:
            num_running, first = await _first_frame_then_state(daemon, proxy, body)
            await wait_idle(daemon)       # the client went away; nginx closes its upstream connection
    assert num_running == 1
    assert json.loads(first.removeprefix("data: "))["choices"][0]["text"]


@needs_nginx
async def test_a_rolling_restart_behind_nginx_reaches_no_client(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    """Two replicas behind deploy/'s nginx site, streaming traffic through it; one replica gets
    SIGTERM's drain mid-run and stops. Every request the clients sent completes, whole: the
    draining replica finishes what it took, nginx passes its 503s and then its refused connections
    on to the other replica, and no client sees a 502, a 503 or a cut stream."""
    first, second = make_daemon(max_num_seqs=4), make_daemon(max_num_seqs=4)
    results: list[tuple[int, bytes]] = []
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(first) as url_a, running_daemon(second) as url_b:
            async with (running_nginx(tmp_path, [_port(url_a), _port(url_b)]) as proxy,
                        httpx.AsyncClient(base_url=proxy, timeout=HANG_GUARD_S) as http):
                stop = anyio.Event()

                async def client(i: int) -> None:
                    while not stop.is_set():
                        body = {"model": SERVED_MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 16,
                                "ignore_eos": True, "stream": True}
                        resp = await http.post("/v1/completions", json=body)
                        results.append((resp.status_code, resp.content))

                async def first_is_gone() -> bool:
                    try:
                        await http.get(f"{url_a}/healthz")
                    except httpx.TransportError:
                        return True
                    return False

                async with anyio.create_task_group() as tg:
                    for i in range(6):
                        tg.start_soon(client, i)
                    await wait_until(lambda: generated_tokens(first) > 0 and generated_tokens(second) > 0)
                    first.request_drain()                      # what SIGTERM does
                    while not await first_is_gone():
                        await anyio.sleep(0.05)
                    after = len(results)
                    await wait_until(lambda: len(results) >= after + 12)   # served by the one left
                    stop.set()
    statuses = [status for status, _ in results]
    assert statuses and set(statuses) == {200}, statuses
    for _, raw in results:
        payloads = data_payloads(raw)                          # whole: ends with [DONE]
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"
