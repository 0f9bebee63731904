"""What one hostile request costs everybody else: a checkout's `forge serve` with a neighbour stream.

For each checkout (`LABEL=PATH`, run alternately, A B A B), a fresh `forge serve` of the default model
on a free loopback port; a neighbour streams a long greedy completion while /healthz is polled every
50 ms, and one hostile request is sent mid-stream. Prints the hostile request's status and time, the
neighbour's worst gap between two SSE chunks against its median, the worst /healthz answer time, and
the daemon's peak RSS (VmHWM) before and after. Asserts nothing; loopback only, bounded in time.

Cases: `stop` (a completion with one stop string of --chars characters), `prompt` (a completion whose
prompt is --chars digits, one token each).

    .venv/bin/python scripts/ab/hostile_probe.py --case stop --chars 80000 \
        --checkout before=/tmp/before --checkout after=. --rounds 2

A checkout without a venv of its own runs with this one's python and its own tree first on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def hostile_body(case: str, chars: int) -> dict[str, object]:
    if case == "stop":
        return {"prompt": "hi", "max_tokens": 1, "stop": ["x" * chars]}
    return {"prompt": "1" * chars, "max_tokens": 1}   # under the default 1 MiB body limit: 1,000,000 at most


async def one_round(label: str, checkout: Path, case: str, chars: int) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_ADDR=f"127.0.0.1:{port}", FORGE_DOWNLOAD="0", PYTHONPATH=str(checkout.resolve()))
    python = checkout / ".venv/bin/python"
    log = tempfile.NamedTemporaryFile(prefix=f"forge-{label}-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(python if python.exists() else sys.executable), "-m", "actors", "serve",
                             "--kv-cache-memory", "512MiB", "--max-model-len", "2048", "--kv-cache-commit", "off"],
                            cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=300) as http:
            with anyio.fail_after(300):
                while True:
                    try:
                        if (await http.get("/healthz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.2)
            rss_before = peak_rss_mib(proc.pid)
            events: list[float] = []
            health: list[float] = []
            result: dict[str, object] = {}
            done = anyio.Event()

            async def neighbour() -> None:
                body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            events.append(time.perf_counter())
                done.set()

            async def poll_health() -> None:
                while not done.is_set():
                    t0 = time.perf_counter()
                    try:
                        await http.get("/healthz")
                    except httpx.TransportError:
                        result["daemon"] = "gone"
                        return
                    health.append(time.perf_counter() - t0)
                    await anyio.sleep(0.05)

            async def hostile() -> None:
                await anyio.sleep(2.0)                      # the neighbour is decoding by then
                t0 = result["sent"] = time.perf_counter()
                try:
                    resp = await http.post("/v1/completions", json=hostile_body(case, chars))
                    result["status"] = resp.status_code
                except httpx.TransportError as exc:
                    result["status"] = f"no answer ({type(exc).__name__})"
                result["answered"] = time.perf_counter()
                result["seconds"] = float(result["answered"]) - t0

            async with anyio.create_task_group() as tg:
                tg.start_soon(neighbour)
                tg.start_soon(poll_health)
                tg.start_soon(hostile)
            alive = proc.poll() is None
            gaps = [b - a for a, b in zip(events, events[1:], strict=False)]
            sent, answered = float(result.get("sent", 0.0)), float(result.get("answered", time.perf_counter()))
            during = [b - a for a, b in zip(events, events[1:], strict=False) if b >= sent and a <= answered]
            print(json.dumps({
                "arm": label, "case": case, "chars": chars, "hostile_status": result.get("status"),
                "hostile_s": round(float(result.get("seconds", float("nan"))), 2),
                "neighbour_worst_gap_ms": round(max(gaps) * 1e3, 1) if gaps else None,
                "neighbour_worst_gap_during_ms": round(max(during) * 1e3, 1) if during else None,
                "neighbour_median_gap_ms": round(statistics.median(gaps) * 1e3, 1) if gaps else None,
                "healthz_worst_ms": round(max(health) * 1e3, 1) if health else None,
                "peak_rss_mib_before": round(rss_before), "peak_rss_mib_after": round(peak_rss_mib(proc.pid))
                if alive else None, "daemon_alive": alive}), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=("stop", "prompt"), required=True)
    parser.add_argument("--chars", type=int, required=True)
    parser.add_argument("--checkout", action="append", required=True, help="LABEL=PATH (repeat)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    arms = [(a.split("=", 1)[0], Path(a.split("=", 1)[1])) for a in args.checkout]
    for _ in range(args.rounds):
        for label, path in arms:
            anyio.run(one_round, label, path, args.case, args.chars)


if __name__ == "__main__":
    main()
