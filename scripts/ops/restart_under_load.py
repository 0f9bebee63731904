"""`systemctl restart forge` under streaming load through nginx, with this script playing systemd.

    .venv/bin/python scripts/ops/restart_under_load.py --clients 32 --max-tokens 64 --restarts 2

What systemd does with deploy/forge.socket and deploy/forge.service, done here by hand: the script binds
and holds the listening socket (forge.socket: a loopback address, Accept=no, Backlog=4096, NoDelay=yes),
starts `forge serve` (as `python -m actors serve`, this checkout's code; the unit's Environment= lines,
FORGE_HOME where `forge pull` put the default model) with the socket as fd 3 (LISTEN_FDS=1, LISTEN_PID,
LISTEN_FDNAMES), a notify socket (NOTIFY_SOCKET, read by a thread as systemd reads it; Type=notify, NotifyAccess=main:
only the main process's messages count) and WATCHDOG_USEC (WatchdogSec=60), and takes the start as
done at READY=1. nginx runs in front with deploy/nginx/forge.conf (its listen and upstream lines
rewritten to free loopback ports, the upstream being the held socket), and the clients stream
/v1/chat/completions and /v1/completions through it, each in a loop.

A restart is what `systemctl restart forge` does with this unit: stop (KillMode=mixed: SIGTERM to the
main process only; if it is still there after TimeoutStopSec=45, SIGKILL to its whole process group),
then at once start a new process on the same, still open socket (RestartSec= applies only to
Restart='s automatic restarts). The clients keep going throughout and for a while after the last one.

Printed (JSON): requests started, completed and failed, failures by kind (connection error, HTTP
status, stream cut mid-way); per restart the old process's drain (SIGTERM to exit), SIGTERM to the new
READY=1, SIGTERM to the first token the new process sent, the worst wait for a first token of the
requests that began during the restart, and whether READY=1 came before the first request the new
process answered. Figures only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
SERVICE = REPO / "deploy" / "forge.service"
SITE = REPO / "deploy" / "nginx" / "forge.conf"
TIMEOUT_STOP_S = 45.0                # forge.service's TimeoutStopSec=
BACKLOG = 4096                       # forge.socket's Backlog=

MAIN_CONF = """\
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log notice;
events {{
    worker_connections 1024;
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

# What systemd does between fork and exec: the socket becomes fd 3 and LISTEN_PID names the process that
# runs ExecStart (this one, after the exec).
ACTIVATED = ("import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); fd != 3 and os.close(fd); "
             "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'; "
             "os.environ['LISTEN_FDNAMES'] = 'forge.socket'; os.environ['WATCHDOG_PID'] = str(os.getpid()); "
             "os.execv(sys.argv[2], sys.argv[2:])")


class NotifySocket:
    """systemd's side of sd_notify: an abstract datagram socket, read at once by a thread, each message kept
    with its arrival time and its sender's pid (SO_PASSCRED, as NotifyAccess=main checks it)."""

    def __init__(self) -> None:
        self.address = f"@forge-restart-{os.getpid()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + self.address[1:])
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, int, list[str]]] = []
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        creds_size = socket.CMSG_SPACE(12)
        while not self._closed.is_set():
            try:
                data, ancillary, _, _ = self.sock.recvmsg(4096, creds_size)
            except TimeoutError:
                continue
            pid = next((int.from_bytes(d[:4], "little") for level, kind, d in ancillary
                        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS), -1)
            self.messages.append((time.monotonic(), pid, data.decode().split("\n")))

    def first(self, pid: int, line: str, after: float = 0.0) -> float | None:
        return next((at for at, sender, lines in list(self.messages)
                     if sender == pid and at >= after and line in lines), None)

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()


def unit_environment() -> dict[str, str]:
    """The [Service] section's Environment= lines."""
    out: dict[str, str] = {}
    for line in SERVICE.read_text().splitlines():
        if line.startswith("Environment="):
            key, value = line.removeprefix("Environment=").split("=", 1)
            out[key] = value
    return out


def start_forge(listener: socket.socket, notify: NotifySocket, log: Path, forge_home: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    env.update(unit_environment())
    env.update(FORGE_HOME=forge_home, NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="60000000",
               PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "actors", "serve"]    # the unit's `forge serve`, from this checkout
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", ACTIVATED, str(listener.fileno()), *command], env=env,
                                stdout=out, stderr=subprocess.STDOUT, pass_fds=[listener.fileno()],
                                cwd=log.parent, start_new_session=True)       # its own group: the unit's cgroup
    return proc


def site_config(listen_port: int, upstream_port: int) -> str:
    text = SITE.read_text()
    text, num_listen = re.subn(r"(?m)^(\s*)listen\s+[^;]+;", rf"\g<1>listen 127.0.0.1:{listen_port};", text)
    text, num_upstream = re.subn(r"(?m)^(\s*)server\s+127\.0\.0\.1:8080;", rf"\g<1>server 127.0.0.1:{upstream_port};",
                                 text)
    assert num_listen == 1 and num_upstream == 1, "forge.conf no longer has one listen and one upstream line"
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class Request:
    kind: str
    started: float
    first_token: float | None = None
    ended: float | None = None
    tokens: int = 0
    outcome: str = ""     # ok (all tokens, [DONE]) or the failure: "connection: ...", "http 503 draining", "cut: ..."


@dataclass(slots=True)
class Restart:
    sigterm: float
    old_pid: int
    old_exit: float = 0.0
    old_code: int | None = None
    killed: bool = False
    new_pid: int = 0
    ready: float | None = None


@dataclass(slots=True)
class Run:
    requests: list[Request] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)


async def stream_one(http: httpx.AsyncClient, model: str, kind: str, i: int, max_tokens: int, req: Request) -> None:
    if kind == "chat":
        path = "/v1/chat/completions"
        body: dict[str, object] = {"messages": [{"role": "user", "content": f"Tell me a story about the number {i}."}]}
    else:
        path, body = "/v1/completions", {"prompt": f"Once upon a time, number {i} said"}
    body.update(model=model, max_tokens=max_tokens, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    try:
        async with http.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                try:
                    code = resp.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    code = resp.text[:60].replace("\n", " ")
                req.outcome = f"http {resp.status_code} {code}"
                return
            done = False
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    frame = json.loads(line[6:])
                    if frame.get("usage"):
                        req.tokens = frame["usage"]["completion_tokens"]
                    if frame.get("choices") and req.first_token is None:
                        req.first_token = time.monotonic()
            req.outcome = "ok" if done and req.tokens == max_tokens else "cut: no [DONE]" if not done else \
                f"short: {req.tokens} tokens"
    except httpx.TransportError as exc:
        stage = "cut" if req.first_token is not None else "connection"
        req.outcome = f"{stage}: {type(exc).__name__}"
    finally:
        req.ended = time.monotonic()


async def client(http: httpx.AsyncClient, model: str, i: int, max_tokens: int, run: Run, stop: anyio.Event) -> None:
    n = 0
    while not stop.is_set():
        kind = "chat" if (i + n) % 2 == 0 else "completions"
        req = Request(kind=kind, started=time.monotonic())
        run.requests.append(req)
        await stream_one(http, model, kind, i * 1000 + n, max_tokens, req)
        n += 1


async def wait_ready(notify: NotifySocket, proc: subprocess.Popen[bytes], log: Path, after: float) -> float:
    while (at := notify.first(proc.pid, "READY=1", after)) is None:
        if proc.poll() is not None:
            raise SystemExit(f"forge exited with {proc.returncode} before READY=1:\n{log.read_text()[-3000:]}")
        await anyio.sleep(0.01)
    return at


async def restart(proc: subprocess.Popen[bytes], start: Callable[[], subprocess.Popen[bytes]], notify: NotifySocket,
                  log: Path) -> tuple[subprocess.Popen[bytes], Restart]:
    """systemctl restart: SIGTERM to the main process, SIGKILL to what is left after TimeoutStopSec, start."""
    rec = Restart(sigterm=time.monotonic(), old_pid=proc.pid)
    proc.send_signal(signal.SIGTERM)                       # KillMode=mixed: the main process only
    deadline = rec.sigterm + TIMEOUT_STOP_S
    while proc.poll() is None and time.monotonic() < deadline:
        await anyio.sleep(0.01)
    if proc.poll() is None:
        rec.killed = True
    rec.old_exit = time.monotonic()
    try:
        os.killpg(proc.pid, signal.SIGKILL)                 # mixed: then SIGKILL to the rest of the cgroup
    except ProcessLookupError:
        pass
    rec.old_code = proc.wait()
    new = start()
    rec.new_pid = new.pid
    rec.ready = await wait_ready(notify, new, log, rec.sigterm)
    return new, rec


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_s": None, "p99_s": None, "max_s": None}
    p50, p99 = np.percentile(values, [50, 99]).tolist()
    return {"p50_s": round(p50, 3), "p99_s": round(p99, 3), "max_s": round(max(values), 3)}


def report(run: Run, t0: float) -> dict[str, object]:
    done = [r for r in run.requests if r.ended is not None]
    failed = [r for r in done if r.outcome != "ok"]
    by_kind: dict[str, int] = {}
    for r in failed:
        by_kind[r.outcome] = by_kind.get(r.outcome, 0) + 1
    restarts = []
    for k, rec in enumerate(run.restarts):
        nxt = run.restarts[k + 1].sigterm if k + 1 < len(run.restarts) else float("inf")
        # The old process sends no token after it exits: a first token after that is the new process's.
        new_tokens = sorted(r.first_token for r in done if r.first_token is not None
                            and rec.old_exit < r.first_token < nxt)
        during = [r for r in done if rec.sigterm <= r.started < (rec.ready or rec.sigterm)]
        first_new = new_tokens[0] if new_tokens else None
        restarts.append({
            "at_s": round(rec.sigterm - t0, 2),
            "drain_s (SIGTERM to the old process's exit)": round(rec.old_exit - rec.sigterm, 3),
            "old_exit_code": rec.old_code, "killed_after_TimeoutStopSec": rec.killed,
            "ready_s (SIGTERM to the new READY=1)": None if rec.ready is None else round(rec.ready - rec.sigterm, 3),
            "first_token_s (SIGTERM to the new process's first token)":
                None if first_new is None else round(first_new - rec.sigterm, 3),
            "ready_before_first_answer": None if first_new is None or rec.ready is None else rec.ready < first_new,
            "requests_started_during_restart": len(during),
            "their_failures": sum(r.outcome != "ok" for r in during),
            "their_first_token_wait": pct([r.first_token - r.started for r in during if r.first_token is not None]),
        })
    steady = [r.first_token - r.started for r in done if r.first_token is not None
              and not any(rec.sigterm <= r.started <= (rec.ready or rec.sigterm) + 5 for rec in run.restarts)]
    return {
        "requests_started": len(run.requests), "completed": len(done) - len(failed), "failed": len(failed),
        "failed_by_kind": by_kind, "unfinished_at_end": len(run.requests) - len(done),
        "first_token_wait_away_from_restarts": pct(steady),
        "restarts": restarts,
    }


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    forge_home = args.forge_home or str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "forge")
    tmp = Path(tempfile.mkdtemp(prefix="forge-restart-"))
    log = tmp / "forge.log"
    notify = NotifySocket()
    listener = socket.socket()
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)       # NoDelay=yes
    listener.bind(("127.0.0.1", 0))
    listener.listen(BACKLOG)
    upstream = listener.getsockname()[1]

    def start() -> subprocess.Popen[bytes]:
        return start_forge(listener, notify, log, forge_home)

    run, t0 = Run(), time.monotonic()
    proc = start()
    nginx_proc: subprocess.Popen[bytes] | None = None
    try:
        first_ready = await wait_ready(notify, proc, log, 0.0)
        port = free_port()
        (tmp / "forge.conf").write_text(site_config(port, upstream))
        (tmp / "nginx.conf").write_text(MAIN_CONF.format(dir=tmp))
        with open(tmp / "nginx.stderr", "wb") as err:
            nginx_proc = subprocess.Popen([nginx, "-p", str(tmp), "-c", str(tmp / "nginx.conf")], stdout=err,
                                          stderr=err)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300.0, connect=10.0),
                                     limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as http:
            while True:
                try:
                    if (await http.get("/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await anyio.sleep(0.05)
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                for i in range(args.clients):
                    tg.start_soon(client, http, model, i, args.max_tokens, run, stop)
                await anyio.sleep(args.warmup)
                for _ in range(args.restarts):
                    proc, rec = await restart(proc, start, notify, log)
                    run.restarts.append(rec)
                    print(f"restart: drain {rec.old_exit - rec.sigterm:.2f} s, READY=1 after "
                          f"{(rec.ready or 0) - rec.sigterm:.2f} s", file=sys.stderr)
                    await anyio.sleep(args.between)
                stop.set()
        out = report(run, t0)
        out.update(clients=args.clients, max_tokens=args.max_tokens, first_start_ready_s=round(first_ready - t0, 2),
                   logs=str(tmp))
        return out
    finally:
        if nginx_proc is not None:
            nginx_proc.send_signal(signal.SIGTERM)
            nginx_proc.wait(10)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(TIMEOUT_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        notify.close()
        listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the first restart")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--between", type=float, default=40.0, help="seconds of load after each restart")
    parser.add_argument("--forge-home", default=None, help="where `forge pull` put the model (default ~/.cache/forge)")
    args = parser.parse_args()
    print(json.dumps(anyio.run(main_async, args), indent=1))


if __name__ == "__main__":
    main()
