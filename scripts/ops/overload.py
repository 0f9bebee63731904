"""How fast forge says no: a burst of many times its admission bound, against a daemon you started.

    .venv/bin/forge serve --addr 127.0.0.1:8282 --max-num-seqs 8 --max-waiting 32 &
    .venv/bin/python scripts/ops/overload.py --base http://127.0.0.1:8282 --requests 320

Every request is sent at once (one connection each); reported: how many were accepted and
refused, the refusals' latency (p50/p99/max, from sending to the 503's last byte), the accepted
ones' latency, and whether every accepted one completed with its tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import httpx
import numpy as np


async def burst(base: str, num: int, max_tokens: int) -> list[tuple[int, float, int]]:
    body = {"prompt": "The capital of France is", "max_tokens": max_tokens, "ignore_eos": True}
    out: list[tuple[int, float, int]] = []
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        ready = anyio.Event()

        async def one() -> None:
            await ready.wait()
            start = time.perf_counter()
            resp = await http.post("/v1/completions", json=body)
            tokens = resp.json()["usage"]["completion_tokens"] if resp.status_code == 200 else 0
            out.append((resp.status_code, time.perf_counter() - start, tokens))

        async with anyio.create_task_group() as tg:
            for _ in range(num):
                tg.start_soon(one)
            await anyio.sleep(0.5)            # every task waits at the line; then all go at once
            ready.set()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8282")
    parser.add_argument("--requests", type=int, default=320)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    results = anyio.run(burst, args.base, args.requests, args.max_tokens)
    refused = [s for code, s, _ in results if code == 503]
    accepted = [(s, t) for code, s, t in results if code == 200]

    def pct(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None}
        p50, p99 = np.percentile(values, [50, 99]).tolist()
        return {"p50_ms": round(1000 * p50, 1), "p99_ms": round(1000 * p99, 1), "max_ms": round(1000 * max(values), 1)}

    print(json.dumps({
        "requests": len(results), "accepted": len(accepted), "refused": len(refused),
        "other": sorted({code for code, _, _ in results} - {200, 503}),
        "refusal_latency": pct(refused), "accepted_latency": pct([s for s, _ in accepted]),
        "accepted_complete": all(t == args.max_tokens for _, t in accepted)}, indent=1))


if __name__ == "__main__":
    main()
