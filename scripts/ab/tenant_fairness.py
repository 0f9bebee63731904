"""A light tenant's time to first token behind a heavy tenant's queue: alone, without a tenant file, with
tenants of one priority, and with the light tenant more urgent (`priority = -1`, asked for by its requests).

Runs an in-process daemon per arm (the default model, --max-num-seqs 8 unless told): the heavy tenant's
--heavy clients each keep a request of 64 ignore_eos tokens in flight (queued first, until 20 wait), then
the light tenant sends --requests 4-token streamed completions one after another, each timed from the
client to its first token. Each is sent the moment the previous one ends, when the daemon's next step has
just begun, so it waits for that whole step; with --gap, after a pause of up to GAP seconds, so it lands
at any moment of a step. Meanwhile the tokens generated a second (nearly all the heavy tenant's) say what
the light tenant's turns cost the heavy one. Not a test: the machine's load moves every figure, so read
the arms against each other.

    .venv/bin/python scripts/ab/tenant_fairness.py --requests 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors.http.gateway import GatewayConfig  # noqa: E402
from actors.http.tenants import parse_tenants  # noqa: E402
from actors.supervisor import Daemon, DaemonConfig, running_daemon  # noqa: E402
from forge.llm import LoadedModel  # noqa: E402
from forge.models.hub import resolve_model  # noqa: E402
from tests.integration.harness import engine_config, generated_tokens, sample, wait_until  # noqa: E402

HEAVY, LIGHT = "heavy-key-0001", "light-key-0002"
ARMS = ("alone", "no-tenants", "equal", "urgent")


async def first_token(http: httpx.AsyncClient, key: str, urgent: bool) -> float:
    body: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": 4, "stream": True}
    if urgent:
        body["priority"] = -1
    start = time.monotonic()
    waited = float("nan")
    async with http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        async for line in r.aiter_lines():
            if waited != waited and line.startswith("data: {"):
                waited = time.monotonic() - start
    return waited


async def arm(loaded: LoadedModel, name: str, *, heavy: int, requests: int, max_num_seqs: int,
              gap: float = 0.0) -> tuple[list[float], dict[str, float]]:
    """The light tenant's waits, and the arm's preemptions (all, and those for fairness) and tokens a second
    while the light tenant's requests ran."""
    tenants = None
    if name != "no-tenants":
        light = {"name": "light", "key": LIGHT, "priority": -1 if name == "urgent" else 0}
        tenants = parse_tenants({"tenant": [{"name": "heavy", "key": HEAVY}, light]})
    gateway = GatewayConfig(served_model_name="m", tenants=tenants)
    daemon = Daemon(DaemonConfig(engine=engine_config(max_num_seqs=max_num_seqs), gateway=gateway, model=loaded.path),
                    loaded)
    waits: list[float] = []
    async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def heavy_stream() -> None:       # one client of the heavy tenant, always a request in flight
            body = {"prompt": "Tell me a long story about", "max_tokens": 64, "ignore_eos": True, "stream": True}
            while True:
                async with http.stream("POST", "/v1/completions", json=body,
                                       headers={"Authorization": f"Bearer {HEAVY}"}) as r:
                    async for _ in r.aiter_lines():
                        pass

        async with anyio.create_task_group() as tg:
            if name != "alone":
                for _ in range(heavy):
                    tg.start_soon(heavy_stream)
                await wait_until(lambda: daemon.scheduler.statistics().num_waiting >= min(20, heavy - max_num_seqs))
            start, tokens = time.monotonic(), generated_tokens(daemon)
            pauses = random.Random(58)
            for _ in range(requests):
                await anyio.sleep(pauses.uniform(0, gap))
                waits.append(await first_token(http, LIGHT, urgent=name == "urgent"))
            rate = (generated_tokens(daemon) - tokens) / (time.monotonic() - start)
            tg.cancel_scope.cancel()
    counts = {"preempted": sample(daemon, "forge:num_preemptions_total"),
              "for fairness": sample(daemon, "forge:fair_preemptions_total"), "tokens/s": rate}
    return waits, counts


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}")
    ap.add_argument("--heavy", type=int, default=32, help="the heavy tenant's clients")
    ap.add_argument("--requests", type=int, default=5, help="the light tenant's requests, one after another")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.0,
                    help="the light tenant pauses up to this many seconds (uniformly) before each request; 0: "
                         "each the moment the previous one ends, when the next step has just begun")
    args = ap.parse_args()
    loaded = LoadedModel.load(str(resolve_model(None, lambda _m: None)), progress=lambda _m: None)
    for name in args.arms.split(","):
        waits, counts = await arm(loaded, name, heavy=args.heavy, requests=args.requests,
                                  max_num_seqs=args.max_num_seqs, gap=args.gap)
        print(f"{name:11s} light TTFT p50 {statistics.median(waits):7.3f} s  each {[round(w, 2) for w in waits]}  "
              + "  ".join(f"{k} {v:.0f}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    anyio.run(main)
