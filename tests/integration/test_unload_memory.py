"""Unloading a model gives its memory back: in a fresh process, each unload returns most of what its load
took (weights' mapping, K/V, the runner's buffers all dropped), and a daemon swapping one model in and out
does not grow from swap to swap. The K/V is committed at each load, so that a load's share of RSS is mostly
what an unload must give back (~300 MiB here with the onnxruntime kernels).

Native allocators may keep some of it for a while: up to ~50 MiB with the onnxruntime kernels, ~17 MiB with
the compiled ones, held after one unload and sometimes returned at a later one (seen in CI and by hand: the
Python heap holds the same objects whether or not it is kept, so it is the allocators', not forge's). Growth
is therefore judged over six swaps against a quarter of one load: a leaked model adds a whole load at every
swap, and a leak of even a twentieth of a load per swap would cross that bound within the five swaps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = r'''
import json, sys
import anyio
from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry, ModelSet
from actors.supervisor import Daemon, DaemonConfig
from forge.config import EngineConfig

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

async def main() -> None:
    engine = EngineConfig(kv_cache_memory=64 << 20, kv_cache_commit=True, max_model_len=256, max_num_seqs=4,
                          blas_threads=1)
    daemon = Daemon(DaemonConfig(engine=engine, gateway=GatewayConfig()))
    models = ModelSet([ModelEntry(model_id="m", source=sys.argv[1])], daemon._build)
    async with anyio.create_task_group() as tg:
        await tg.start(models.run)
        await models.load("m")                       # a warm-up load: imports, thread pools, kernels built
        models.unload("m")
        await models.wait_unloaded("m")
        swaps = []
        for _ in range(6):
            before = rss()
            await models.load("m")
            loaded = rss()
            models.unload("m")
            await models.wait_unloaded("m")
            swaps.append({"before": before, "loaded": loaded, "after": rss()})
        tg.cancel_scope.cancel()
    print(json.dumps(swaps))

anyio.run(main)
'''


def test_unloading_a_model_returns_its_memory(default_model_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", PROBE, str(default_model_path)], capture_output=True, text=True,
                         cwd=repo, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    swaps = json.loads(run.stdout.strip().splitlines()[-1])
    for swap in swaps:
        took = swap["loaded"] - swap["before"]
        assert took > 64 << 20, swaps                          # the load did take memory (weights + K/V)
        assert swap["after"] - swap["before"] <= took * 0.25, swaps    # and the unload gave most of it back
    took = swaps[0]["loaded"] - swaps[0]["before"]
    grown = swaps[-1]["after"] - swaps[0]["after"]
    assert grown <= max(took * 0.25, 32 << 20), swaps          # swapping does not leak
