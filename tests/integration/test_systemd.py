"""The systemd units in deploy/: `systemd-analyze verify` accepts them without a warning, and the service's
exact ExecStart command, with its Environment= lines and environment file, serves and drains. Then forge
under systemd's protocols, this test playing systemd: the notify socket (READY=1 only once the model
serves, STATUS=, WATCHDOG=1, STOPPING=1) and socket activation (a listening socket handed as fd 3, kept
open across a restart that refuses no connection).

Only the paths that differ on this machine change: the venv the unit expects at /opt/forge is this
checkout's, FORGE_HOME is the test cache (where `forge pull` put the model: the unit itself never
downloads at start-up, docs/operations.md), and the listen address is a free port.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx

from tests.integration.harness import HANG_GUARD_S, NotifySocket, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "forge.service"
SOCKET_UNIT = REPO / "deploy" / "forge.socket"
INSTALLED_VENV = "/opt/forge/.venv"


def unit_settings() -> dict[str, list[str]]:
    """The [Service] section's settings, in order, by key."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def local_unit(tmp_path: Path) -> Path:
    venv = Path(sys.executable).parent.parent
    path = tmp_path / "forge.service"
    path.write_text(UNIT.read_text().replace(INSTALLED_VENV, str(venv)))
    return path


def test_systemd_analyze_verifies_the_units_without_a_warning(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "the test needs systemd-analyze: run scripts/install-test-deps"
    socket_unit = tmp_path / "forge.socket"                 # next to forge.service, the service it starts
    socket_unit.write_text(SOCKET_UNIT.read_text())
    done = subprocess.run([analyze, "verify", "--man=no", str(local_unit(tmp_path)), str(socket_unit)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout == done.stderr == "", done.stdout + done.stderr


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key] = value.strip('"')
    return out


async def test_the_units_exact_command_serves_and_drains(tmp_path: Path, default_model_path: Path) -> None:
    settings = unit_settings()
    [exec_start] = settings["ExecStart"]
    command = shlex.split(exec_start.replace(INSTALLED_VENV, str(Path(sys.executable).parent.parent)))
    assert command[1:] == ["serve"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(env_file(REPO / "deploy" / "forge.env.example"))     # the template /etc/forge/forge.env starts from
    for assignment in settings.get("Environment", []):
        key, value = assignment.split("=", 1)
        env[key] = value
    assert env["FORGE_HOME"] == "/var/cache/forge" and env["FORGE_DOWNLOAD"] == "0"
    port = free_port()
    env["FORGE_HOME"] = str(default_model_path.parent.parent)          # where `forge pull` put the model
    env["FORGE_ADDR"] = f"127.0.0.1:{port}"
    log = tmp_path / "forge.log"
    with open(log, "wb") as out:
        proc = await anyio.open_process(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, log.read_text)
                resp = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert b"downloading" not in log.read_bytes().lower()


async def test_under_the_unit_a_missing_model_is_a_one_line_error_not_a_download(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "empty"), FORGE_DOWNLOAD="0", FORGE_ADDR=f"127.0.0.1:{free_port()}")
    done = await anyio.run_process([sys.executable, "-m", "actors", "serve"], env=env, check=False)
    err = done.stderr.decode()
    assert done.returncode == 2 and "FORGE_DOWNLOAD=0" in err and "forge pull" in err, err
    assert not (tmp_path / "empty" / "models").exists()


def test_the_units_are_type_notify_with_a_watchdog_and_share_one_address() -> None:
    settings = unit_settings()
    assert settings["Type"] == ["notify"] and settings["NotifyAccess"] == ["main"]
    assert settings["WatchdogSec"] == ["60"]
    text = SOCKET_UNIT.read_text()
    listen = [line.split("=", 1)[1] for line in text.splitlines() if line.startswith("ListenStream=")]
    assert listen == ["127.0.0.1:8080"] and "Accept=no" in text


# What systemd does between fork and exec for a socket-activated service: the listening socket becomes fd 3,
# LISTEN_FDS=1 and LISTEN_PID=<the service's own pid>; then `forge serve` (as the entry point would run it).
ACTIVATED = ("import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); fd != 3 and os.close(fd); "
             "os.environ['LISTEN_PID'] = str(os.getpid()); os.environ['LISTEN_FDS'] = '1'; "
             "os.environ['LISTEN_FDNAMES'] = 'forge.socket'; "
             "os.execv(sys.executable, [sys.executable, '-m', 'actors', 'serve'])")


@contextmanager
def handed_socket() -> Iterator[socket.socket]:
    """The listening socket systemd would hold for forge.socket: open across every forge process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    try:
        yield sock
    finally:
        sock.close()


def start_activated(listener: socket.socket, log: Path, default_model_path: Path,
                    **extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    env.update(FORGE_HOME=str(default_model_path.parent.parent), FORGE_DOWNLOAD="0", PYTHONPATH=str(REPO),
               FORGE_ADDR=f"127.0.0.1:{free_port()}", **extra)     # not where it listens: the handed socket wins
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-c", ACTIVATED, str(listener.fileno())], env=env,
                                stdout=out, stderr=subprocess.STDOUT, pass_fds=[listener.fileno()], cwd=log.parent)


async def exited(proc: subprocess.Popen[bytes]) -> int:
    while (code := proc.poll()) is None:
        await anyio.sleep(0.05)
    return code


async def test_forge_under_systemds_protocols(tmp_path: Path, default_model_path: Path) -> None:
    """A connection made while the model loads waits and is answered once it serves, after READY=1 (sent only
    then); STATUS= lines, EXTEND_TIMEOUT_USEC= while loading, WATCHDOG=1 pings every WATCHDOG_USEC/2 at
    least, requests served on the handed socket (not FORGE_ADDR), STOPPING=1 on SIGTERM, exit 0."""
    notify, log = NotifySocket(), tmp_path / "forge.log"
    with handed_socket() as listener:
        port = listener.getsockname()[1]
        proc = start_activated(listener, log, default_model_path, NOTIFY_SOCKET=notify.address,
                               WATCHDOG_USEC="400000")
        try:
            with anyio.fail_after(HANG_GUARD_S):
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                    assert "READY=1" not in notify.lines()           # forge is still starting
                    health = await http.get("/healthz")     # waits in the handed socket's backlog until ready
                    assert health.status_code == 200, log.read_text()
                    assert "READY=1" in notify.lines()      # sent before the first connection was accepted
                    first = notify.messages[0]
                    assert first[0] == "STATUS=loading SmolLM2-135M-Instruct" and any(
                        line.startswith("EXTEND_TIMEOUT_USEC=") for line in first), first
                    resp = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
                    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
                    ready_at = len(notify.lines())
                    await anyio.sleep(1.5)
                    after = notify.lines()[ready_at:]
                    assert after.count("WATCHDOG=1") >= 3, after          # one every 0.2 s at least
                    statuses = [line for line in after if line.startswith("STATUS=")]
                    assert statuses and all(s.startswith("STATUS=serving SmolLM2-135M-Instruct: 0 running, "
                                                          "0 waiting, ") and s.endswith(" tokens/s")
                                            for s in statuses), statuses
                    assert not any(line.startswith("EXTEND_TIMEOUT_USEC=") for line in after)
                    proc.send_signal(signal.SIGTERM)
                    assert await exited(proc) == 0, log.read_text()
            lines = notify.lines()
            assert "STOPPING=1" in lines[lines.index("READY=1"):], lines
            assert '"socket_activated"' in log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            notify.close()


async def test_a_restart_on_the_handed_socket_refuses_no_connection(tmp_path: Path, default_model_path: Path) -> None:
    """Two forge processes in turn on one listening socket, as systemd hands forge.socket's across
    `systemctl restart forge`: a client sending requests throughout, each on a new connection, sees no
    connection refused or reset; those that arrive between the processes wait in the backlog."""
    log = tmp_path / "forge.log"
    outcomes: list[str] = []
    with handed_socket() as listener:
        port = listener.getsockname()[1]
        procs = [start_activated(listener, log, default_model_path)]
        try:
            with anyio.fail_after(HANG_GUARD_S * 2):
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S,
                                             limits=httpx.Limits(max_keepalive_connections=0)) as http:
                    while True:                                    # the first process up
                        assert procs[0].poll() is None, log.read_text()
                        if (await http.get("/healthz")).json()["status"] == "ok":
                            break
                        await anyio.sleep(0.1)
                    stop = anyio.Event()

                    async def client() -> None:
                        while not stop.is_set():
                            try:
                                resp = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                                outcomes.append(str(resp.status_code) if resp.status_code == 200
                                                else f"{resp.status_code} {resp.json()['error']['code']}")
                            except httpx.TransportError as exc:
                                outcomes.append(f"{type(exc).__name__}: {exc}")
                            await anyio.sleep(0.02)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(client)
                        await anyio.sleep(1.0)
                        procs[0].send_signal(signal.SIGTERM)
                        assert await exited(procs[0]) == 0, log.read_text()
                        restarted_at = len(outcomes)
                        procs.append(start_activated(listener, log, default_model_path))
                        while len(outcomes) < restarted_at + 5:           # answered by the second process
                            assert procs[1].poll() is None, log.read_text()
                            await anyio.sleep(0.1)
                        stop.set()
                    procs[1].send_signal(signal.SIGTERM)
                    assert await exited(procs[1]) == 0, log.read_text()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    failures = [o for o in outcomes if o != "200"]
    # A connection the first process accepted just before its drain began may get a 503 "draining" (the
    # client may send it again, Retry-After): never a refused or reset connection.
    assert all(o == "503 draining" for o in failures), failures
    assert outcomes[:restarted_at].count("200") >= 1 and outcomes[restarted_at:].count("200") >= 4, outcomes
