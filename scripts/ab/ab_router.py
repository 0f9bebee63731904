"""Router policies on a multi-turn workload: kv_aware (fed by forge's KV events) and cache_aware against
round_robin, three forge replicas behind the real vllm-router.

Starts --replicas `forge serve` processes on loopback, each pinned to its own cores (--cpus-per-replica,
sched_setaffinity, FORGE_BLAS_THREADS to match: on a 2-core machine the replicas share the cores and the
figures say so) with --kv-events, then per policy a router in front of them. Each arm: every replica's
prefix cache flushed, then --conversations conversations of --turns turns, all opening with one shared
system prompt and a system line of their own, run by --clients concurrent clients (a client runs one
conversation's turns in order, each turn's prompt the whole conversation so far). Reported per arm: the
prefix-cache hit rate over all replicas (forge:prefix_cache_hits / queries in the arm), time to first token
p50/p99 (streamed), output tokens/s and requests served per replica.

    .venv/bin/python scripts/ab/ab_router.py --conversations 24 --turns 6 --clients 4
    .venv/bin/python scripts/ab/ab_router.py --conversations 2 --turns 2 --clients 2 --max-tokens 4   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

SYSTEM = ("You are the assistant of a public library. Answer in two sentences at most, politely, and say "
          "when you are not sure. The library opens at nine, closes at six, and lends books for three weeks. ") * 4
QUESTIONS = ["Can I renew a book online?", "What if I lose my card?", "Do you have study rooms?",
             "Can children borrow films?", "Is there a printer?", "How do I donate books?", "Where do I park?",
             "Do you run reading groups?"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_binary() -> str:
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if found is None:
        raise SystemExit("vllm-router is not installed: pip install -e '.[test]'")
    return found


def pinned(cpus: set[int]) -> Any:
    return lambda: os.sched_setaffinity(0, cpus)


def wait_http(url: str, proc: subprocess.Popen[bytes], path: str = "/health") -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)


@contextmanager
def replicas(args: argparse.Namespace) -> Iterator[list[tuple[str, str]]]:
    """(HTTP URL, KV-event endpoint) per replica, each pinned to its cores."""
    cores = sorted(os.sched_getaffinity(0))
    procs, out = [], []
    try:
        for i in range(args.replicas):
            start = (i * args.cpus_per_replica) % len(cores)
            cpus = {cores[(start + j) % len(cores)] for j in range(args.cpus_per_replica)}
            port, kv_port = free_port(), free_port()
            env = {**os.environ, "FORGE_BLAS_THREADS": str(len(cpus)), "FORGE_LOG_FORMAT": "json"}
            cmd = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}", "--kv-events",
                   "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}", "--kv-cache-commit", "off",
                   "--log-level", "warning", *(["--model", args.model] if args.model else [])]
            procs.append(subprocess.Popen(cmd, env=env, preexec_fn=pinned(cpus), stdout=subprocess.DEVNULL))
            out.append((f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv_port}"))
        for (url, _), proc in zip(out, procs, strict=True):
            wait_http(url, proc)
        yield out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


@contextmanager
def router(policy: str, workers: list[tuple[str, str]], model_name: str) -> Iterator[str]:
    port = free_port()
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *[u for u, _ in workers], "--prometheus-port", str(free_port()), "--log-level", "warning"]
    if policy == "kv_aware":
        cmd += ["--kv-event-model", model_name, "--kv-event-block-size", "16"]
        for url, endpoint in workers:
            cmd += ["--kv-event-source", f"{url}={endpoint}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base, proc, "/v1/models")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def counters(url: str) -> dict[str, float]:
    got = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("forge:prefix_cache_hits_total", "forge:prefix_cache_queries_total",
                     "forge:request_success_total"):
            if line.startswith(name):
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


async def turn(http: httpx.AsyncClient, base: str, model: str, messages: list[Any], max_tokens: int
               ) -> tuple[float, int, str]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, text, tokens = time.perf_counter(), None, "", 0
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += choice["delta"]["content"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - start), tokens, text


async def workload(base: str, args: argparse.Namespace, model: str) -> tuple[list[float], int, float]:
    ttfts: list[float] = []
    num_tokens = 0
    pending = list(range(args.conversations))
    start = time.perf_counter()

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal num_tokens
        while pending:
            c = pending.pop(0)
            messages: list[Any] = [{"role": "system", "content": f"{SYSTEM}You are talking to reader {c}."}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)]})
                ttft, tokens, text = await turn(http, base, model, messages, args.max_tokens)
                ttfts.append(ttft)
                num_tokens += tokens
                messages.append({"role": "assistant", "content": text})

    async with httpx.AsyncClient(timeout=600) as http, anyio.create_task_group() as tg:
        for _ in range(args.clients):
            tg.start_soon(client, http)
    return ttfts, num_tokens, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "kv_aware"])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--cpus-per-replica", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--model", default=None, help="a GGUF path or catalog name; default: forge's default")
    args = parser.parse_args()
    print(f"# {args.replicas} replicas on {len(os.sched_getaffinity(0))} cores "
          f"({args.cpus_per_replica} each, shared where there are fewer), {args.conversations} conversations of "
          f"{args.turns} turns, {args.clients} clients, max_tokens {args.max_tokens}")
    with replicas(args) as workers:
        model = httpx.get(workers[0][0] + "/v1/models").json()["data"][0]["id"]
        for policy in args.policies:
            for url, _ in workers:
                httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
            before = [counters(u) for u, _ in workers]
            with router(policy, workers, model) as base:
                ttfts, num_tokens, wall = anyio.run(workload, base, args, model)
            after = [counters(u) for u, _ in workers]
            delta = [{k: a.get(k, 0.0) - b.get(k, 0.0) for k in a} for a, b in zip(after, before, strict=True)]
            hits = sum(d.get("forge:prefix_cache_hits_total", 0.0) for d in delta)
            queries = sum(d.get("forge:prefix_cache_queries_total", 0.0) for d in delta)
            served = [int(d.get("forge:request_success_total", 0.0)) for d in delta]
            print(json.dumps({"policy": policy, "prefix_hit_rate": round(hits / queries, 3) if queries else 0.0,
                              "ttft_p50_s": round(statistics.median(ttfts), 3),
                              "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
                              "output_tok_s": round(num_tokens / wall, 2), "wall_s": round(wall, 1),
                              "served_per_replica": served}))


if __name__ == "__main__":
    main()
