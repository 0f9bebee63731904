"""One big embeddings request against a neighbour's completions (issue 51, case 2): what the neighbour sees.

Against a forge daemon you started on loopback (`forge serve --addr 127.0.0.1:8282`): after one warm-up
completion, sends one POST /v1/embeddings of --inputs short distinct inputs while a neighbour client runs
streamed completions one after another (--max-tokens each, ignore_eos) until the embeddings answer comes,
and reports the embeddings' status and seconds; the neighbour's requests, how many got 503, its worst
gap between two tokens and its worst and median latency (request to last frame) over those served.
Bounded: the whole run stops after --max-seconds.

    .venv/bin/python scripts/ab/hostile_embeddings.py --base http://127.0.0.1:8282 --inputs 2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from urllib.parse import urlsplit

import anyio
import httpx

TOPICS = ["cats", "rain", "markets", "trains", "bread", "chess", "rivers", "stars"]


async def neighbour_request(http: httpx.AsyncClient, max_tokens: int) -> tuple[int, float, float]:
    """(status, latency, worst gap between token frames) of one streamed completion."""
    body = {"prompt": "The capital of France is", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    start = time.monotonic()
    last: float | None = None
    worst = 0.0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                worst = max(worst, now - last)
            last = now
        return resp.status_code, time.monotonic() - start, worst


async def run(base: str, num_inputs: int, max_tokens: int, max_seconds: float) -> dict[str, object]:
    inputs = [f"Sentence {i} is about {TOPICS[i % len(TOPICS)]}." for i in range(num_inputs)]
    statuses: list[int] = []
    latencies: list[float] = []
    gaps: list[float] = []
    big: dict[str, object] = {}
    done = anyio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=max_seconds) as http:
        await neighbour_request(http, max_tokens)                            # warm-up, not reported

        async def embed() -> None:
            start = time.monotonic()
            resp = await http.post("/v1/embeddings", json={"input": inputs})
            big.update(status=resp.status_code, seconds=round(time.monotonic() - start, 2),
                       vectors=len(resp.json().get("data", [])) if resp.status_code == 200 else 0)
            done.set()

        async def neighbour() -> None:
            await anyio.sleep(0.2)                                           # the big request is in
            while not done.is_set():
                status, latency, gap = await neighbour_request(http, max_tokens)
                statuses.append(status)
                if status == 200:
                    latencies.append(latency)
                    gaps.append(gap)
                else:
                    await anyio.sleep(0.05)                                  # a client's short back-off

        with anyio.move_on_after(max_seconds):
            async with anyio.create_task_group() as tg:
                tg.start_soon(embed)
                tg.start_soon(neighbour)
    return {"embeddings": big, "neighbour_requests": len(statuses),
            "neighbour_503": sum(1 for s in statuses if s == 503),
            "neighbour_other": sum(1 for s in statuses if s not in (200, 503)),
            "neighbour_worst_gap_s": round(max(gaps, default=0.0), 3),
            "neighbour_worst_latency_s": round(max(latencies, default=0.0), 3),
            "neighbour_median_latency_s": round(statistics.median(latencies), 3) if latencies else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8282")
    parser.add_argument("--inputs", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of each neighbour completion")
    parser.add_argument("--max-seconds", type=float, default=300.0)
    args = parser.parse_args()
    if urlsplit(args.base).hostname not in ("127.0.0.1", "localhost", "::1"):
        parser.error("--base must be a loopback address")
    print(json.dumps(anyio.run(run, args.base, args.inputs, args.max_tokens, args.max_seconds)))


if __name__ == "__main__":
    main()
