"""Embeddings per second through forge's HTTP route, for all-MiniLM-L6-v2 at batch 1 and 32.

Starts `forge serve --model all-minilm-l6-v2` on a free port (or uses --base, a daemon you started), then,
for each batch size, runs closed-loop clients for --seconds: batch 1 is --concurrency clients each
sending one input per request (the encoder actor batches what arrives together); batch 32 is one client
sending 32 inputs per request. Inputs are sentences of 10-30 words. Prints embeddings/s and requests/s.

    .venv/bin/python scripts/ab/ab_embeddings.py --seconds 10 --blas-threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time

import anyio
import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while rain falls on quiet city streets and "
         "people read books about science history music art and distant stars").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 30))) + "." for _ in range(n)]


async def run_arm(base: str, batch: int, clients: int, seconds: float) -> tuple[int, int]:
    """(embeddings, requests) completed in `seconds` by `clients` closed-loop clients."""
    texts = sentences(1024)
    done = [0, 0]
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        async def client(k: int) -> None:
            i = k
            while time.monotonic() < deadline:
                inputs = [texts[(i + j) % len(texts)] for j in range(batch)]
                resp = await http.post("/v1/embeddings", json={"input": inputs if batch > 1 else inputs[0]})
                resp.raise_for_status()
                done[0] += len(resp.json()["data"])
                done[1] += 1
                i += batch * clients

        async with anyio.create_task_group() as tg:
            for k in range(clients):
                tg.start_soon(client, k)
    return done[0], done[1]


def start_daemon(blas_threads: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "actors", "serve", "--model", "all-minilm-l6-v2", "--addr", f"127.0.0.1:{port}",
           "--blas-threads", str(blas_threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env={**os.environ}, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit("forge serve exited before it was ready")
        time.sleep(0.1)
    proc.terminate()
    raise SystemExit("forge serve did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="a running daemon serving all-minilm-l6-v2 (else one is started)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8, help="clients of the batch-1 arm")
    p.add_argument("--blas-threads", type=int, default=1)
    args = p.parse_args()
    proc, base = (None, args.base) if args.base else start_daemon(args.blas_threads)
    try:
        anyio.run(run_arm, base, 1, 1, 1.0)                                  # warm-up
        print(f"all-MiniLM-L6-v2 through POST /v1/embeddings, {args.seconds:g} s per arm")
        for batch, clients in ((1, 1), (1, args.concurrency), (32, 1)):
            num, reqs = anyio.run(run_arm, base, batch, clients, args.seconds)
            print(f"batch {batch:>2}, {clients} client(s): {num / args.seconds:8.1f} embeddings/s "
                  f"({reqs / args.seconds:.1f} requests/s)")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
