"""Embeddings per second through forge's HTTP route, for all-MiniLM-L6-v2 at batch 1 and 32.

Starts `forge serve --model all-minilm-l6-v2` on a free port (or uses --base, a daemon you started), then,
for each batch size, runs closed-loop clients for --seconds: batch 1 is --concurrency clients each
sending one input per request (the encoder actor batches what arrives together); batch 32 is one client
sending 32 inputs per request. Inputs are sentences of 10-30 words. Prints embeddings/s and requests/s.

    .venv/bin/python scripts/ab/ab_embeddings.py --seconds 10 --blas-threads 2

With --peer-python (the reference venv's python, which has sentence-transformers on torch CPU), it
measures instead the two libraries side by side in one run, A B A B: forge's encoder (forge/models/bert, in
this process) against sentence-transformers (scripts/ab/embed_peer_st.py, a child process), on the same
model directory and texts, batch 1 and batch 32, --blas-threads threads each, tokenizing included:

    .venv/bin/python scripts/ab/ab_embeddings.py --peer-python "$(scripts/reference/refvenv.sh)" \
        --blas-threads 2 --count 256 --rounds 3
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


def library_ab(peer_python: str, threads: int, count: int, rounds: int) -> None:
    """forge's encoder against sentence-transformers, in turn each round: embeddings/s at batch 1 and 32."""
    import json
    import statistics
    import tempfile

    from threadpoolctl import threadpool_limits

    from forge.models.bert.encoder import LoadedEncoder
    from forge.models.hub import resolve_model

    directory = resolve_model("all-minilm-l6-v2", lambda _m: None)
    encoder = LoadedEncoder.load(directory)
    texts = sentences(1024)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    child_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "embed_peer_st.py")
    child = subprocess.Popen([peer_python, child_script, str(directory), "--threads", str(threads), "--texts", f.name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    ready = json.loads(child.stdout.readline())

    def peer(batch: int) -> float:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{batch} {count}\n")
        child.stdin.flush()
        return float(json.loads(child.stdout.readline())["seconds"])

    def forge_arm(batch: int) -> float:
        start = time.perf_counter()
        for i in range(0, count, batch):
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            encoder.embed([encoder.encode(t) for t in chunk])
        return time.perf_counter() - start

    rates: dict[tuple[str, int], list[float]] = {}
    with threadpool_limits(limits=threads):
        forge_arm(32)                                                           # warm-up
        for _ in range(rounds):
            for batch in (1, 32):
                for name, arm in (("forge", forge_arm), ("sentence-transformers", peer)):
                    rates.setdefault((name, batch), []).append(count / arm(batch))
    child.stdin.close()
    child.wait(timeout=60)
    os.unlink(f.name)
    print(f"all-MiniLM-L6-v2, {count} texts an arm, {rounds} rounds, {threads} thread(s); peer torch "
          f"{ready['torch']} ({ready['threads']} threads); embeddings/s, median (min-max)")
    for batch in (1, 32):
        ours, theirs = rates[("forge", batch)], rates[("sentence-transformers", batch)]
        print(f"batch {batch:>2}: forge {statistics.median(ours):7.1f} ({min(ours):.1f}-{max(ours):.1f}), "
              f"sentence-transformers {statistics.median(theirs):7.1f} ({min(theirs):.1f}-{max(theirs):.1f}), "
              f"forge / peer {statistics.median(ours) / statistics.median(theirs):.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", help="a running daemon serving all-minilm-l6-v2 (else one is started)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8, help="clients of the batch-1 arm")
    p.add_argument("--blas-threads", type=int, default=1)
    p.add_argument("--peer-python", help="the reference venv's python: run the library A/B against "
                   "sentence-transformers instead")
    p.add_argument("--count", type=int, default=256, help="texts an arm of the library A/B")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the library A/B")
    args = p.parse_args()
    if args.peer_python:
        library_ab(args.peer_python, args.blas_threads, args.count, args.rounds)
        return
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
