"""A soak: minutes of mixed traffic against a fresh `forge serve`, with everything a long-running
daemon meets (streamed and plain, chat and completions, clients that leave, over-long prompts, a
burst past the admission bound now and then), then checks that it kept nothing.

    .venv/bin/python scripts/ops/soak.py --minutes 10

The KV cache is 512 MiB by default here: its pages become resident as blocks are first used, and
a cache this size is all touched within the warm-up minute, so RSS after warm-up measures growth
rather than the cache filling in.

Reports: requests by kind and status, unexpected outcomes (any 5xx, a transport error, a status
the kind did not expect), the server's RSS after the first minute and at the end, the KV blocks
held once idle, and TTFT / inter-token latency percentiles minute by minute. Exit status 1 when
anything unexpected happened, when blocks stay held, or when RSS grew by 5% or more after warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np

from forge_bench.servers import free_port, stop, wait_healthy

KINDS = ("stream", "plain", "chat-stream", "chat", "leaves", "too-long")
# What each kind may get. 503 is right for any of them while a burst holds the admission queue full.
EXPECTED = {"too-long": {400, 503}, "leaves": {200, 503}}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, http: httpx.AsyncClient, seed: int) -> None:
        self.http = http
        self.rng = random.Random(seed)
        self.outcomes: Counter[tuple[str, int]] = Counter()
        self.unexpected: list[str] = []
        self.latency: dict[int, dict[str, list[float]]] = defaultdict(lambda: {"ttft": [], "itl": []})
        self.start = time.monotonic()

    def note(self, kind: str, status: int, detail: str = "") -> None:
        self.outcomes[(kind, status)] += 1
        allowed = EXPECTED.get(kind, {200, 503})
        if status not in allowed:
            self.unexpected.append(f"{kind}: {status} {detail[:200]}")

    async def one(self, kind: str) -> None:
        rng = self.rng
        chat = kind.startswith("chat")
        body: dict[str, Any] = {"max_tokens": rng.choice([8, 32, 128]), "temperature": rng.choice([0.0, 0.8])}
        if chat:
            question = f"Tell me something about the number {rng.randint(1, 999)}."
            body["messages"] = [{"role": "user", "content": question}]
        elif kind == "too-long":
            body["prompt"] = "word " * 9000
        else:
            body["prompt"] = "The story begins: " + " ".join(rng.choice(["river", "stone", "light", "the", "a", "old"])
                                                             for _ in range(rng.randint(5, 400)))
        stream = kind in ("stream", "chat-stream", "leaves")
        body["stream"] = stream
        path = "/v1/chat/completions" if chat else "/v1/completions"
        minute = int((time.monotonic() - self.start) // 60)
        try:
            if not stream:
                resp = await self.http.post(path, json=body)
                self.note(kind, resp.status_code, resp.text)
                return
            sent = time.monotonic()
            last, frames, leave_after = None, 0, rng.randint(1, 6)
            async with self.http.stream("POST", path, json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.monotonic()
                    if last is None:
                        self.latency[minute]["ttft"].append(now - sent)
                    else:
                        self.latency[minute]["itl"].append(now - last)
                    last, frames = now, frames + 1
                    if kind == "leaves" and frames >= leave_after:
                        break
                self.note(kind, resp.status_code)
        except httpx.HTTPError as exc:
            self.note(kind, -1, f"{type(exc).__name__}: {exc}")

    async def worker(self, until: float) -> None:
        while time.monotonic() < until:
            await self.one(self.rng.choice(KINDS))

    async def bursts(self, until: float, size: int) -> None:
        while time.monotonic() + 60 < until:
            await anyio.sleep(60)
            async def one() -> None:
                try:
                    resp = await self.http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
                    self.note("burst", resp.status_code, resp.text)
                except httpx.HTTPError as exc:
                    self.note("burst", -1, str(exc))
            async with anyio.create_task_group() as tg:
                for _ in range(size):
                    tg.start_soon(one)


def pct(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p99 = np.percentile(values, [50, 99]).tolist()
    return f"{1000 * p50:.0f} / {1000 * p99:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--burst", type=int, default=150, help="requests in the burst sent once a minute")
    parser.add_argument("--forge-args", default="--max-num-seqs 16 --max-waiting 64 --kv-cache-memory 512MiB "
                                                     "--max-model-len 2048")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}", "--log-level", "warning",
           *args.forge_args.split()]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(base + "/healthz", proc)
            rss: dict[str, float] = {"start": rss_mib(proc.pid)}

            async def run() -> Soak:
                limits = httpx.Limits(max_connections=None)
                async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
                    soak = Soak(http, args.seed)
                    until = time.monotonic() + 60 * args.minutes

                    async def after_warm_up() -> None:
                        await anyio.sleep(min(60, 30 * args.minutes))
                        rss["after warm-up"] = rss_mib(proc.pid)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(after_warm_up)
                        tg.start_soon(soak.bursts, until, args.burst)
                        for _ in range(args.concurrency):
                            tg.start_soon(soak.worker, until)
                    for _ in range(600):                          # idle: nothing running, nothing held
                        stats = (await http.get("/stats")).json()
                        if stats["requests"]["running"] == stats["requests"]["waiting"] == 0:
                            break
                        await anyio.sleep(0.5)
                    soak.idle = stats                             # type: ignore[attr-defined]
                    return soak

            soak = anyio.run(run)
            rss["end"] = rss_mib(proc.pid)
        finally:
            stop(proc)
    idle = soak.idle                                              # type: ignore[attr-defined]
    held = idle["kv"]["counts"]["u"] + idle["kv"]["counts"]["s"]
    growth = (rss["end"] - rss["after warm-up"]) / rss["after warm-up"]
    by_kind: dict[str, dict[str, int]] = defaultdict(dict)
    for (kind, status), n in sorted(soak.outcomes.items()):
        by_kind[kind][str(status)] = n
    report = {"minutes": args.minutes, "requests": sum(soak.outcomes.values()), "by_kind": by_kind,
              "unexpected": soak.unexpected[:20], "num_unexpected": len(soak.unexpected),
              "rss_mib": {k: round(v, 1) for k, v in rss.items()}, "rss_growth_after_warm_up": round(growth, 4),
              "blocks_held_when_idle": held, "kv_usage_when_idle": idle["kv"]["usage"]}
    print(json.dumps(report, indent=1))
    print("\n| minute | streams started | TTFT p50 / p99 ms | ITL p50 / p99 ms |\n|---|---|---|---|")
    for minute in sorted(soak.latency):
        lat = soak.latency[minute]
        print(f"| {minute + 1} | {len(lat['ttft'])} | {pct(lat['ttft'])} | {pct(lat['itl'])} |")
    ok = not soak.unexpected and held == 0 and growth < 0.05
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
