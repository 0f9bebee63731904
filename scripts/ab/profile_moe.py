"""Where a mixture of experts' decode step spends its time: the block's parts, and whole steps.

Not part of forge and not run by tests: a measuring tool for issue 53 (the 30B-A3B and OLMoE shapes of
scripts/peer/make_bench_models.py).

    .venv/bin/python scripts/ab/profile_moe.py --model ~/.cache/forge/bench-models/bench-30b-a3b-12l-Q4_K_M.gguf \
        --rows 1 8 32 --seqs 1 8

1. the host's memory bandwidth (a 1 GiB copy on the kernels' pool, bytes read per second);
2. the block alone (forge.models.llama.mixture.mixture) on every layer in turn, so that the experts come
   from memory, not the cache, for steps of --rows rows (random normed rows, the real routers): ms per
   layer, the experts it ran, and the experts' bytes read per second, for each of --paths in turn:
   forge's mixture(), `loop` (one product per expert and projection, as before the grouped product),
   `parts` (that loop with clocks between its parts: the router's product, the routing, the grouping,
   the experts' products, the rest);
3. whole decode steps of --seqs streams (scripts/ab/profile_step.py's set-up: random K/V, the real
   forward), the step's milliseconds, tokens per second, and the bytes one stream's token reads (the
   attention's weights, the router, the top k experts of every layer, the head) per second.

Other jobs on the machine skew every figure: the load average is printed beside each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_step  # noqa: E402

from forge.kernels import products  # noqa: E402
from forge.llm import LoadedModel  # noqa: E402
from forge.models.llama import mixture as mixture_mod  # noqa: E402
from forge.models.llama.linear import matmul  # noqa: E402


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in __import__("os").getloadavg())


def bandwidth(rounds: int = 3) -> float:
    src = np.ones(1 << 30, dtype=np.uint8)
    dst = np.empty_like(src)
    products.parallel_copy(dst, src)
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        products.parallel_copy(dst, src)
        best = max(best, src.size / (time.perf_counter() - t0))
    return best


def expert_bytes(moe: object) -> int:
    """Bytes of one expert (gate, up and down) of a layer."""
    gate_up, down = moe.gate_up, moe.down                        # type: ignore[attr-defined]
    return (gate_up.nbytes + down.nbytes) // gate_up.num_experts


def parts_of_block(x: np.ndarray, moe: object, config: object, activation: object,
                   clocks: dict[str, float]) -> tuple[np.ndarray, int]:
    """mixture()'s loop with clocks between its parts; returns its output and the experts run."""
    t0 = time.perf_counter()
    logits = matmul(x, moe.router)                                                       # type: ignore[attr-defined]
    t1 = time.perf_counter()
    ids, weights = mixture_mod.route(logits, config.num_used, config.norm_top_k,        # type: ignore[attr-defined]
                                     config.weights_scale)                               # type: ignore[attr-defined]
    t2 = time.perf_counter()
    groups = list(mixture_mod.expert_groups(ids, weights))
    t3 = time.perf_counter()
    out = np.zeros_like(x)
    gate_up_s = act_s = down_s = rest_s = 0.0
    for expert, tokens, chosen in groups:
        a = time.perf_counter()
        rows = x[tokens]
        h = matmul(rows, moe.gate_up[expert])                                            # type: ignore[attr-defined]
        b = time.perf_counter()
        h = activation(h)                                                                # type: ignore[operator]
        c = time.perf_counter()
        y = matmul(h, moe.down[expert])                                                  # type: ignore[attr-defined]
        d = time.perf_counter()
        y *= chosen[:, None]
        out[tokens] += y
        e = time.perf_counter()
        gate_up_s += b - a
        act_s += c - b
        down_s += d - c
        rest_s += e - d
    for part, s in (("router", t1 - t0), ("route", t2 - t1), ("groups", t3 - t2), ("gate_up", gate_up_s),
                    ("activation", act_s), ("down", down_s), ("scatter", rest_s)):
        clocks[part] += s
    return out, len(groups)


def loop_block(x: np.ndarray, moe: object, config: object, activation: object) -> np.ndarray:
    """The block as a loop over the active experts, one product per expert and projection (the
    numpy reference's way, and every backend's before the grouped product)."""
    ids, weights = mixture_mod.route(matmul(x, moe.router), config.num_used,          # type: ignore[attr-defined]
                                     config.norm_top_k, config.weights_scale)          # type: ignore[attr-defined]
    out = np.zeros_like(x)
    for expert, tokens, chosen in mixture_mod.expert_groups(ids, weights):
        y = matmul(activation(matmul(x[tokens], moe.gate_up[expert])), moe.down[expert])  # type: ignore
        y *= chosen[:, None]
        out[tokens] += y
    return out


def block_case(loaded: LoadedModel, rows: int, reps: int, paths: list[str]) -> None:
    """Each path in turn over every layer, reps times (A B A B): ms a layer (median), experts run."""
    model = loaded.model
    layers = [layer for layer in model.weights.layers if layer.moe is not None]
    config = model.config.moe
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, model.config.hidden_size)).astype(np.float32)
    x /= np.sqrt((x * x).mean(axis=1, keepdims=True))
    per_expert = expert_bytes(layers[0].moe)
    active = statistics.mean(len(np.unique(mixture_mod.route(matmul(x, layer.moe.router), config.num_used,
                                                                 config.norm_top_k)[0])) for layer in layers)
    times: dict[str, list[float]] = defaultdict(list)
    clocks: dict[str, float] = defaultdict(float)
    for rep in range(reps + 1):
        for path in paths:
            for layer in layers:
                t0 = time.perf_counter()
                if path == "parts":
                    parts_of_block(x, layer.moe, config, model._activation, clocks)
                elif path == "loop":
                    loop_block(x, layer.moe, config, model._activation)
                else:
                    mixture_mod.mixture(x, layer.moe, config, matmul, model._activation)
                if rep:
                    times[path].append(time.perf_counter() - t0)
        if rep == 0:
            clocks.clear()
    for path in paths:
        ms = statistics.median(times[path]) * 1e3
        print(f"block {path:8s} {rows:3d} rows: {ms:7.2f} ms a layer, {active:5.1f} experts, experts' bytes "
              f"{active * per_expert / (ms / 1e3) / 1e9:5.1f} GB/s (load {load_average()})", flush=True)
    if "parts" in paths:
        total = sum(clocks.values())
        count = reps * len(layers)
        print("    " + ", ".join(f"{k} {v / count * 1e3:.2f} ms ({v / total:.0%})" for k, v in clocks.items()))


def token_bytes(loaded: LoadedModel) -> int:
    """The bytes one stream's token reads: every layer's attention weights, router and top k experts;
    the head (norms aside)."""
    w, c = loaded.model.weights, loaded.model.config
    total = int(w.head.nbytes)
    for layer in w.layers:
        total += int(layer.wqkv.nbytes) + int(layer.wo.nbytes)
        if layer.moe is not None and c.moe is not None:
            total += int(layer.moe.router.nbytes) + c.moe.num_used * expert_bytes(layer.moe)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3, help="passes over every layer per block case")
    ap.add_argument("--paths", default="mixture", help="block paths, alternated: mixture (forge's), loop (one "
                    "product per expert), parts (the loop with clocks between its parts)")
    ap.add_argument("--seqs", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--numerics", default="reference")
    ap.add_argument("--matmul", default="split:2", help="STRATEGY:THREADS, as forge serve's default")
    args = ap.parse_args()
    print(f"load average at start {load_average()}")
    t0 = time.perf_counter()
    loaded = LoadedModel.load(args.model, kernels=args.kernels, numerics=args.numerics, progress=lambda _m: None)
    print(f"model {loaded.name}: loaded in {time.perf_counter() - t0:.1f} s; kernels {loaded.model.weights.kernels}, "
          f"fast {loaded.model.weights.fast}")
    bw = bandwidth()
    print(f"memory bandwidth (1 GiB copy, kernel pool, bytes read): {bw / 1e9:.1f} GB/s")
    for rows in args.rows:
        block_case(loaded, rows, args.reps, args.paths.split(","))
    if not args.seqs:
        return
    per_token = token_bytes(loaded)
    mode = (args.matmul.split(":")[0], int(args.matmul.split(":")[1]))
    profile_step.remember()
    step_args = argparse.Namespace(steps=args.steps, context=args.context, temperature=0.0, top_p=1.0)
    rng = np.random.default_rng(0)
    for num_seqs in args.seqs:
        step_s, parts = profile_step.decode_case(loaded, step_args, mode, num_seqs, rng)
        cells = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items() if v * 1e3 >= 0.05)
        line = f"decode {num_seqs:3d} streams: {step_s * 1e3:7.1f} ms a step, {num_seqs / step_s:6.2f} tok/s"
        if num_seqs == 1:
            line += (f"; a token reads {per_token / 1e6:.0f} MB: {per_token / step_s / 1e9:.1f} GB/s, "
                     f"{per_token / step_s / bw:.0%} of the copy's")
        print(f"{line} (load {load_average()})\n    ms: {cells}", flush=True)


if __name__ == "__main__":
    main()
