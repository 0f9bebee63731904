"""Unloading a model gives its memory back: in a fresh process, RSS after load + unload is within 10%
of what it was before the load (weights' mapping, K/V, the runner's buffers all dropped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = r'''
import json, sys
import anyio
from actors.gateway import GatewayConfig
from actors.model_set import ModelEntry, ModelSet
from actors.supervisor import Daemon, DaemonConfig
from forge.config import EngineConfig

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

async def main() -> None:
    engine = EngineConfig(kv_cache_memory=64 << 20, max_model_len=256, max_num_seqs=4, blas_threads=1)
    daemon = Daemon(DaemonConfig(engine=engine, gateway=GatewayConfig()))
    models = ModelSet([ModelEntry(model_id="m", source=sys.argv[1])], daemon._build_set)
    async with anyio.create_task_group() as tg:
        await tg.start(models.run)
        await models.load("m")                       # a warm-up load: imports, thread pools, kernels built
        models.unload("m")
        await models.wait_unloaded("m")
        before = rss()
        await models.load("m")
        loaded = rss()
        models.unload("m")
        await models.wait_unloaded("m")
        after = rss()
        tg.cancel_scope.cancel()
    print(json.dumps({"before": before, "loaded": loaded, "after": after}))

anyio.run(main)
'''


def test_unloading_a_model_returns_its_memory(default_model_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", PROBE, str(default_model_path)], capture_output=True, text=True,
                         cwd=repo, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    rss = json.loads(run.stdout.strip().splitlines()[-1])
    assert rss["loaded"] - rss["before"] > 50 << 20, rss       # the load did take memory (weights + K/V)
    assert rss["after"] <= rss["before"] * 1.10, rss
