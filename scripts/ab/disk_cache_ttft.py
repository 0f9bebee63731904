"""Time to first token of a long shared prefix: cold, warm in RAM, and from the disk tier after a restart.

Starts `forge serve` itself (this checkout's, through sys.executable) with --kv-cache-dir in a temporary
directory. Each round takes a prefix of its own (~--prefix-tokens tokens, so its cold run is cold):
daemon A answers prefix + question 1 (cold) and prefix + question 2 (the prefix warm in RAM), is stopped
with SIGTERM (the drain writes the cached blocks out), and daemon B, on the same directory, answers
prefix + question 3 (the prefix from disk). Each request is a greedy completion of one token, its
wall time from the client (what a user waits for the first token); `cached` is its usage's
cached_tokens. Reported per round, then the medians.

    .venv/bin/python scripts/ab/disk_cache_ttft.py --prefix-tokens 4000 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from forge.models.hub import resolve_model
from forge.text.tokenizer import Tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(args: argparse.Namespace, kv_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    cmd = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}", "--kv-cache-dir", str(kv_dir),
           "--max-model-len", str(args.max_model_len), *args.serve_args]
    if args.model:
        cmd += ["--model", args.model]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"forge exited: see {log}")
        try:
            if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> float:
    """SIGTERM and wait; the seconds the drain (with its write-out) took."""
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    return time.perf_counter() - t0


def ttft(base: str, prompt: str) -> tuple[float, int, int]:
    """(seconds, prompt_tokens, cached_tokens) of a one-token greedy completion."""
    t0 = time.perf_counter()
    reply = httpx.post(f"{base}/v1/completions", timeout=600,
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    seconds = time.perf_counter() - t0
    if reply.status_code != 200:
        raise SystemExit(f"forge answered {reply.status_code}: {reply.text}")
    usage: dict[str, Any] = reply.json()["usage"]
    return seconds, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def prefix(round_id: int, num_tokens: int, tokenizer: Tokenizer) -> str:
    """`num_tokens` tokens (or a few more) of a tool list and instructions, different for each round."""
    parts, i = [f"Session {round_id}. You are an agent with these tools:"], 0
    while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < num_tokens:
        parts.extend(f"tool_{round_id}_{j}(path, mode={j % 7}) reads item {j * 37 % 1000};" for j in range(i, i + 20))
        i += 20
    return " ".join(parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix-tokens", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None, help="GGUF file or catalog name (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("serve_args", nargs="*", help="more `forge serve` flags (after --)")
    args = p.parse_args()
    rows = []
    tokenizer = Tokenizer.from_gguf(resolve_model(args.model, lambda _: None))
    with tempfile.TemporaryDirectory(prefix="forge-kv-") as tmp:
        kv_dir, log = Path(tmp) / "kv", Path(tmp) / "forge.log"
        for r in range(args.rounds):
            shared = prefix(r, args.prefix_tokens, tokenizer)
            proc, base = start(args, kv_dir, log)
            cold = ttft(base, shared + " Question: which tool reads item 37? Answer:")
            warm = ttft(base, shared + " Question: which tool reads item 74? Answer:")
            drain_s = stop(proc)
            proc, base = start(args, kv_dir, log)
            disk = ttft(base, shared + " Question: which tool reads item 111? Answer:")
            stop(proc)
            rows.append((cold, warm, disk, drain_s))
            print(f"round {r}: prompt {cold[1]} tokens | cold {cold[0]:.2f} s (cached {cold[2]}) | "
                  f"warm RAM {warm[0]:.3f} s (cached {warm[2]}) | disk after restart {disk[0]:.3f} s "
                  f"(cached {disk[2]}) | drain with write-out {drain_s:.2f} s", flush=True)
    cold_s = statistics.median(r[0][0] for r in rows)
    warm_s = statistics.median(r[1][0] for r in rows)
    disk_s = statistics.median(r[2][0] for r in rows)
    print(f"median: cold {cold_s:.2f} s, warm RAM {warm_s:.3f} s ({warm_s / cold_s:.3f}x), "
          f"from disk after restart {disk_s:.3f} s ({disk_s / cold_s:.3f}x)")


if __name__ == "__main__":
    main()
