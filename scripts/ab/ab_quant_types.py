"""The blocks backend's product per tensor type, against Q4_K's: x [rows, 2048] @ W.T for W a 2048 x 2048
matrix of random blocks of each type, per step size (--rows) and numerics, in interleaved rounds: each
figure the fastest single call (on a loaded machine the one least disturbed) and the median of the
rounds' fastest. With --stack N, N distinct matrices taken in turn (each call a matrix the previous
N - 1 calls did not read: out of L2, though a big L3 may still hold them). Prints the load average
before and after: the figures are only as steady as the machine.

Figures only.

    .venv/bin/python scripts/ab/ab_quant_types.py [--rows 1,8] [--threads 2] [--rounds 15] [--reps 20]
        [--stack 0] [--types Q4_K,Q2_K,Q3_K,IQ4_NL,IQ4_XS,MXFP4] [--numerics reference,fast] [--isa native]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.kernels import compiled, products

Q = GGMLQuantizationType
N = K = 2048
# Byte offsets of each type's float16 scales (random bytes there could be inf or NaN); MXFP4's E8M0 byte apart.
F16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.MXFP4: []}


def random_matrix(rng: np.random.Generator, qtype: GGMLQuantizationType) -> npt.NDArray[np.uint8]:
    """W [N, K] of qtype as the file's bytes [N, bytes per row]: random codes, sane scales."""
    if qtype in (Q.F16, Q.BF16, Q.F32):
        w = rng.standard_normal((N, K)).astype(np.float32) * 0.02
        if qtype == Q.F32:
            return w.view(np.uint8)
        if qtype == Q.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(N * K // elems, nbytes), dtype=np.uint8)
    for off in F16_AT[qtype]:
        blocks[:, off:off + 2] = rng.uniform(0.001, 0.02, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(118, 124, len(blocks))
    return blocks.reshape(N, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=20, help="calls per type, step size and numerics a round")
    parser.add_argument("--stack", type=int, default=0, help="distinct matrices read in turn (0: one matrix)")
    parser.add_argument("--types", default="Q4_K,Q2_K,Q3_K,IQ4_NL,IQ4_XS,MXFP4,Q4_0,Q6_K,F16,BF16")
    parser.add_argument("--numerics", default="reference,fast")
    parser.add_argument("--isa", default="native", choices=list(compiled.ISA_FLAGS))
    args = parser.parse_args()
    lib = compiled.library_at(args.isa)
    products.pool_threads(args.threads, lib=lib)
    numerics = [n for n in args.numerics.split(",") if n == "reference" or products.qmatmul_fast(lib)]
    types = [Q[name] for name in args.types.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    stacks = {t: [random_matrix(rng, t) for _ in range(max(1, args.stack))] for t in types}
    descriptors = {t: [products.qparts([(b, int(t))]) for b in stacks[t]] for t in types}
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}; {os.cpu_count()} cores; "
          f"{args.threads} threads; ISA {args.isa}; fast = {products.qmatmul_fast_kind(lib) or 'none'}")
    fastest: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.rounds):
        for r in rows:
            x = rng.standard_normal((r, K)).astype(np.float32)
            out = np.empty((r, N), dtype=np.float32)
            for mode in numerics:
                for t in types:                               # interleaved: drift hits every type alike
                    calls = []
                    for i in range(args.reps):
                        d = descriptors[t][i % len(descriptors[t])]
                        t0 = time.perf_counter()
                        products.qmatmul(x, K, d, out, lib=lib, fast=mode == "fast")
                        calls.append(time.perf_counter() - t0)
                    fastest.setdefault((t.name, r, mode), []).append(min(calls))
    print(f"load average after:  {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    where = "one matrix" if args.stack <= 1 else f"{args.stack} matrices in turn"
    print(f"\nus per {N} x {K} product, {where}: the fastest call of {args.rounds} x {args.reps} (the median of "
          f"the rounds' fastest); GB/s of the type's bytes at the fastest; x Q4_K's fastest")
    for mode in numerics:
        print(f"\n{mode}:")
        print(f"{'type':8s} {'bytes':>9s}" + "".join(f" {f'{r} row(s)':>34s}" for r in rows))
        for t in types:
            nbytes = stacks[t][0].nbytes
            cells = []
            for r in rows:
                runs = fastest[(t.name, r, mode)]
                base = min(fastest.get((Q.Q4_K.name, r, mode), runs))
                cells.append(f"{min(runs) * 1e6:7.1f} ({statistics.median(runs) * 1e6:7.1f}) us "
                             f"{nbytes / min(runs) / 1e9:5.1f} GB/s {min(runs) / base:4.2f}x")
            print(f"{t.name:8s} {nbytes:9d}" + "".join(f" {c:>34s}" for c in cells))


if __name__ == "__main__":
    main()
