"""A/B of the kernel backends on the real model's matmuls (all layers + the head), in one process.

For each backend (forge.kernels): load time, the weights' bytes, the peak RSS after loading, and
the matmuls' tokens/s at each step size, measured in interleaved rounds (A B A B) so that a
busier moment of the machine hits every backend alike. Figures only.

    .venv/bin/python scripts/ab_kernels.py [--model PATH] [--tokens 1,8,32,128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

from forge.bench import matmul_seconds
from forge.llama.linear import configure_matmul
from forge.llm import LoadedModel


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--kernels", default="numpy,onnxruntime,fast")
    parser.add_argument("--tokens", default="1,8,32,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    configure_matmul("split", args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    loaded = {}
    for name in args.kernels.split(","):
        before = rss_mib()
        t0 = time.perf_counter()
        loaded[name] = LoadedModel.load(args.model, kernels=name, progress=lambda _m: None)
        gc.collect()
        print(f"{name:12s} load {time.perf_counter() - t0:5.2f} s  weights "
              f"{loaded[name].model.weights.nbytes / 2**20:6.1f} MiB  RSS +{rss_mib() - before:6.1f} MiB")
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for t in tokens:
            for name, model in loaded.items():
                s = matmul_seconds(model.model.weights, t, num_head_rows=t, min_time_s=0.3, min_reps=2)
                rates.setdefault((name, t), []).append(t / s)
    print("\nmatmul-only tokens/s (median of rounds), all layers + head, tokens per step:")
    print("tokens " + "".join(f"{name:>14s}" for name in loaded))
    for t in tokens:
        print(f"{t:6d} " + "".join(f"{statistics.median(rates[(n, t)]):14.1f}" for n in loaded))
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
