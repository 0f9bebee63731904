"""The servers a serving benchmark runs: forge, llama.cpp's llama-server, or the peer that
`forge bench compare --peer-command` names, each started on a free port and waited on until healthy,
measured (its peak RSS, what it runs on) and stopped (a peer's whole process group). `forge bench
compare` (forge_bench.bench_cli) starts its servers here, as the A/B scripts (scripts/ab, scripts/ops)
start theirs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LLAMA_FLAGS = ["--threads", "2", "--threads-batch", "2", "-cb", "--no-webui"]


def _llama_host_flags() -> list[str]:
    """llama-server's weight repacking (its default: K-quants and Q4_0 interleaved for its AVX2/AVX-512
    GEMMs at load) stays on, as a user gets it, except on hosts with AMX tiles, where its AMX kernel
    for Q4_1 dies with SIGILL (--no-repack there)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return ["--no-repack"] if "amx_tile" in flags.split() else []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 600) -> None:
    """Until `url` answers 200; raises RuntimeError if proc exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become healthy")


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak RSS in MiB (VmHWM), or None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def group_peak_rss_mib(pgid: int) -> float | None:
    """The peak RSS summed over every process of a process group (a peer that runs its engine in
    child processes): an upper bound, since pages shared between them count once per process."""
    total, found = 0.0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[2] != str(pgid):
                continue
        except (OSError, IndexError):
            continue
        rss = peak_rss_mib(int(stat.parent.name))
        if rss is not None:
            total, found = total + rss, True
    return round(total, 1) if found else None


def _find_llama_server(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("llama-server")
    if found:
        return found
    raise SystemExit("forge: llama-server not found; pass --llama-server PATH (see docs/benchmarks.md)")


def _cpu_features() -> str:
    """The host's vector and matrix extensions, from /proc/cpuinfo (Linux)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = sorted({f for f in flags.split(":", 1)[1].split() if f.startswith(("avx2", "avx512", "amx"))})
    return " ".join(wanted) or "no AVX2/AVX-512/AMX"


def _server_info(server: str, base: str, log_path: Path, binary: str | None = None) -> str:
    """What each server runs on: llama-server's version and build lines (a peer built without
    native CPU flags is several times slower and makes every ratio meaningless: see
    docs/benchmarks.md for how to check its build), the host's CPU features; forge's kernel
    backend from its metrics."""
    if server == "forge":
        try:
            text = httpx.get(base + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return "forge: kernels unknown"
        kernels = [line[len("forge:kernels_info"):].rsplit(" ", 1)[0] for line in text.splitlines()
                   if line.startswith("forge:kernels_info{") and line.rstrip().endswith(" 1.0")]
        return f"forge: kernels {', '.join(kernels) or 'unknown'}"
    lines = log_path.read_text(errors="replace").splitlines()
    wanted = [line.strip() for line in lines if line.lstrip().startswith(("build:", "system_info:"))]
    if binary is not None:
        try:
            version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
            wanted += [line.strip() for line in (version.stdout + version.stderr).splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return f"llama-server: {' / '.join(wanted) or 'version unknown'}; host CPU: {_cpu_features()}"


def start(server: str, args: argparse.Namespace, model_path: str,
          max_streams: int) -> tuple[subprocess.Popen[bytes], str]:
    """`server` ("forge", "llama-server", or the peer of args.peer_command) on model_path, sized for
    max_streams, on a free port, its log under args.logs; returns once it is healthy, with its base URL
    (its start-up time and what it runs on are noted in args.ready_s and args.server_info)."""
    port = free_port()
    env = dict(os.environ)
    own_group = False
    if server != "forge" and args.peer_command:
        cmd = ["bash", "-c", args.peer_command.format(port=port, model=model_path, streams=max(max_streams, 1))]
        health, own_group = args.peer_health, True
    elif server == "forge":
        cmd = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}", "--model", model_path,
               "--max-num-seqs", str(max(max_streams, 1)), "--blas-threads", "2", "--log-level", "warning",
               *args.forge_args.split()]
        health = "/healthz"
    else:
        ctx = args.context_per_stream * max_streams
        cmd = [_find_llama_server(args.llama_server), "-m", model_path, "--host", "127.0.0.1", "--port", str(port),
               "-c", str(ctx), "-np", str(max(max_streams, 1)), *LLAMA_FLAGS, *_llama_host_flags(),
               *args.llama_args.split()]
        health = "/health"
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.logs) / f"{server}-{port}.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=own_group)
    try:
        wait_healthy(base + health, proc)
    except BaseException:
        stop(proc, own_group)
        raise
    args.ready_s[server] = round(time.monotonic() - started, 2)   # start-up: launched until healthy
    info = (f"{server}: {args.peer_command}" if own_group
            else _server_info(server, base, log_path, None if server == "forge" else cmd[0]))
    print(info, file=sys.stderr)
    args.server_info[server] = info
    return proc, base


def stop(proc: subprocess.Popen[bytes], group: bool = False) -> None:
    """SIGTERM (to the whole process group when `group`: a peer that forks workers), then SIGKILL
    after a minute."""
    def send(sig: signal.Signals) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass
    send(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()
