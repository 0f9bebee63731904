"""Where a model's load goes: the stages a daemon runs before a model serves (forge.models.loading.load_served,
forge.engine.assembly.build_engine, the gateway's grammar engine), timed over --repeat loads in one process, and with
--profile the functions that take the most of one more load (cProfile, by own time).

    .venv/bin/python scripts/ab/profile_load.py --model gemma-3-270m --repeat 2 --profile 14

--model: a catalog name or a GGUF path (default: the default model). An older commit: run it with
PYTHONPATH set to a worktree of it (`git worktree add .bench/old COMMIT`). What a cold request waits for beyond
these is its first step (scripts/ab/ab_models.py measures the whole, through HTTP).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Any

from forge.config import EngineConfig
from forge.engine.assembly import build_engine
from forge.models.hub import resolve_model
from forge.models.loading import load_served
from forge.sampling.structured import Grammars

try:
    from actors.supervisor import edge_grammars
except ImportError:          # a checkout before 0c673a9 (an A/B with PYTHONPATH=it): the gateway built its own
    def edge_grammars(loaded: Any, parts: Any) -> Grammars:  # noqa: ARG001 - the same call as the new one
        return Grammars(loaded.tokenizer)


def one_load(path: str, cfg: EngineConfig) -> dict[str, float]:
    t0 = time.perf_counter()
    loaded = load_served(path, kernels=cfg.kernels, numerics=cfg.numerics, progress=lambda _: None)
    t1 = time.perf_counter()
    parts = build_engine(loaded, cfg, None)          # type: ignore[arg-type]
    t2 = time.perf_counter()
    edge_grammars(loaded, parts)                     # type: ignore[arg-type]
    t3 = time.perf_counter()
    return {"load_served": t1 - t0, "build_engine": t2 - t1, "edge_grammars": t3 - t2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, help="print this many functions of one more, profiled load")
    ap.add_argument("--kernels", default="auto")
    args = ap.parse_args()
    path = str(resolve_model(args.model, lambda _: None))
    cfg = EngineConfig(kernels=args.kernels)
    for i in range(args.repeat):
        times = one_load(path, cfg)
        print(f"load {i + 1}: " + ", ".join(f"{k} {v:.2f} s" for k, v in times.items())
              + f"; in all {sum(times.values()):.2f} s", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        one_load(path, cfg)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
