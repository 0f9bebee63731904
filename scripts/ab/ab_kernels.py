"""A/B of forge's kernels against what they replace, on the real model, in one process.

    products   (default) each backend's matmuls, all layers + the head: load time, weights' bytes,
               RSS after loading, tokens/s per step size, in interleaved rounds (A B A B)
    attention  one layer's decode attention at 32 sequences x --context tokens (200) of the default
               model's heads (or --shape 1.7b's): the numpy path against the compiled kernel on 1
               and 2 threads and on the products' pool (as the blocks backend serves), and the
               deterministic numerics' kernel (det_attention.c) on that pool, per K/V
               dtype (--kv-dtypes), with the bytes of K/V read and the error against float64
    head       the tied head (49,152 x 576): the compiled Q8_0 kernel against onnxruntime's two
               4-bit planes of the same blocks, per number of rows
    head-march the Q8_0 head kernel built for other CPUs (--march, e.g. x86-64-v3: AVX2 without
               AVX-512) and run here on one thread, the current source against --baseline REV's
    layers     the blocks kernel alone on eight random layers of the 1.7B model's shapes, per step
               size (--tokens), on 1 and 2 threads, beside a 1 GiB copy: weights read per second
    bandwidth  one decoding row's products (all layers + head, --kernels' first backend) as a share
               of the memory bandwidth, a 1 GiB copy on two threads measured alternately in the run
    int8       what the AMX path was measured against: int8 activations on the same tiles
               (onnxruntime's DynamicQuantizeMatMul over int8 weights, per tensor, or per row with
               each row scaled to 1 first), one layer's products per row count against onnxruntime's
               float32 and the AMX bfloat16x3 paths, then the fidelity of each on the reference data
               (the model's steps of 64+ rows on it, as the AMX path takes them)

Figures only.

    .venv/bin/python scripts/ab/ab_kernels.py [products] [--model PATH] [--tokens 1,8,32,128] [--rounds 3]
    .venv/bin/python scripts/ab/ab_kernels.py --kernels onnxruntime,amx --tokens 32,64,128,512 --head-rows 1
    .venv/bin/python scripts/ab/ab_kernels.py attention [--kv-dtypes float32,float16,int8] [--context 200]
        [--shape 135m|1.7b]
    .venv/bin/python scripts/ab/ab_kernels.py head
    .venv/bin/python scripts/ab/ab_kernels.py head-march --march x86-64-v3,native --baseline 257b046
    .venv/bin/python scripts/ab/ab_kernels.py int8
    .venv/bin/python scripts/ab/ab_kernels.py bandwidth --kernels blocks --model PATH
    .venv/bin/python scripts/ab/ab_kernels.py layers --tokens 1,2,4,8,16,32 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from forge.kernels import compiled, products
from forge.kernels.onnx_linear import OnnxLinear
from forge.kernels.quant_blocks import affine_blocks
from forge.llm import LoadedModel
from forge.models.forward_batch import ForwardBatch
from forge.models.gguf_file import read_gguf
from forge.models.hub import resolve_model
from forge.models.llama.attention import attend
from forge.models.llama.attention_plan import plan_attention
from forge.models.llama.kv_dtype import quantize_int8, row_bytes, storage_dtype, to_storage
from forge.models.llama.linear import Q8Matrix, active_pool, configure_matmul
from forge.offline_bench import matmul_seconds


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn over reps calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cmd_attention(reps: int, kv_dtypes: list[str], context: int, shape: str) -> None:
    rng = np.random.default_rng(0)
    nh, nkv = (9, 3) if shape == "135m" else (32, 32)
    num_seqs, hd, bs = 32, 64, 16
    width = -(-context // bs)
    num_blocks = num_seqs * width + 64
    tables = rng.permutation(num_blocks)[: num_seqs * width].reshape(num_seqs, width).astype(np.int64)
    lens = np.full(num_seqs, context, dtype=np.int64)
    k = rng.standard_normal((num_blocks, bs, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((num_blocks, bs, nkv, hd)).astype(np.float32)
    q = (rng.standard_normal((num_seqs, nh, hd)) / 8).astype(np.float32)
    rows = np.arange(num_seqs, dtype=np.int64)
    batch = ForwardBatch(token_ids=rows, positions=lens - 1, slot_mapping=rows, query_start=np.arange(num_seqs + 1),
                         context_lens=lens, block_tables=tables, sample_indices=rows)
    config = SimpleNamespace(num_heads=nh, num_kv_heads=nkv, head_dim=hd)
    ref = np.empty((num_seqs, nh, hd))
    for s in range(num_seqs):
        keys = k[tables[s]].reshape(-1, nkv, hd)[:context].astype(np.float64)
        vals = v[tables[s]].reshape(-1, nkv, hd)[:context].astype(np.float64)
        for h in range(nh):
            scores = keys[:, h // (nh // nkv)] @ q[s, h]
            w = np.exp(scores - scores.max())
            ref[s, h] = (w / w.sum()) @ vals[:, h // (nh // nkv)]
    cases = (("numpy", False, 2, False), ("compiled, 1 thread", True, 1, False),
             ("compiled, 2 threads", True, 2, False), ("compiled, on the pool", True, 2, True),
             ("deterministic, the pool", True, 2, True),
             *((("head by head, the pool", True, 2, True),) if nh == nkv else ()))
    products.pool_threads(2)
    print(f"32 sequences x {context} keys, {nh} query heads, {nkv} KV heads of {hd}")
    for dtype in kv_dtypes:
        scales: tuple[np.ndarray, np.ndarray] | None = None
        if dtype == "int8":
            (kd, ks), (vd, vs) = quantize_int8(k), quantize_int8(v)
            scales = (ks, vs)
        else:
            kd, vd = to_storage(k, np.dtype(storage_dtype(dtype))), to_storage(v, np.dtype(storage_dtype(dtype)))
        read = num_seqs * context * 2 * nkv * row_bytes(dtype, hd)
        for label, fused, threads, on_pool in cases:
            if label == "numpy" and dtype != kv_dtypes[0]:
                continue
            configure_matmul("split", threads)
            if label.startswith("deterministic") and dtype == "int8":
                continue                                        # the deterministic numerics refuse an int8 cache
            plan = plan_attention(batch, config, bs, fused=fused, decode_on_pool=on_pool,  # type: ignore[arg-type]
                                  det=label.startswith("deterministic"))
            # MHA heads go position by position from 8 KV heads; "head by head" times the order before
            before = compiled.decode_by_position(1 << 40 if label.startswith("head by head") else 8)
            out = attend(plan, q, kd, vd, scales=scales)
            seconds = timed(lambda plan=plan, kd=kd, vd=vd, scales=scales: attend(plan, q, kd, vd, scales=scales), reps)
            compiled.decode_by_position(before)
            print(f"{dtype:8s} {label:22s} {seconds * 1e3:6.3f} ms per layer   K/V {read / 2**20:5.1f} MiB "
                  f"({read / seconds / 1e9:5.1f} GB/s)   error vs float64 {np.max(np.abs(out - ref)):.1e}")


def cmd_head(model: str | None, reps: int) -> None:
    configure_matmul("split", 2)
    tensor = read_gguf(resolve_model(model, lambda _m: None)).tensors["token_embd.weight"]
    blocks = np.array(tensor.data, dtype=np.uint8)                  # [V, H / 32 * 34] Q8_0 rows
    rows, cols = tensor.shape                                        # [V, H] in numpy order
    q8 = Q8Matrix(blocks, (rows, cols))
    planes = OnnxLinear([affine_blocks(blocks, tensor.tensor_type, (rows, cols))], num_threads=2)
    rng = np.random.default_rng(0)
    print("rows   compiled Q8_0   onnxruntime planes")
    for n in (1, 3, 8, 32, 64):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        print(f"{n:4d}   {timed(lambda x=x: q8.matmul(x), reps) * 1e3:9.2f} ms   "
              f"{timed(lambda x=x: planes.matmul(x), reps) * 1e3:12.2f} ms")


def cmd_head_march(model: str | None, reps: int, marches: list[str], baseline: str) -> None:
    """Build q8_matmul.c (this checkout's, and `baseline`'s from git) for each -march and time the
    head through ctypes, one thread, per number of rows of x."""
    tensor = read_gguf(resolve_model(model, lambda _m: None)).tensors["token_embd.weight"]
    blocks = np.array(tensor.data, dtype=np.uint8)
    rows, cols = tensor.shape
    source = Path(compiled.__file__).with_name("q8_matmul.c")
    flags = [f for f in compiled.CFLAGS if not f.startswith("-march=")]
    rng = np.random.default_rng(0)
    print("build                      " + "".join(f"{n:>9d}" for n in (1, 8, 32, 64)) + "   rows: ms, one thread")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(source.with_name("dot.h"), tmp)
        old = Path(tmp) / "q8_old.c"
        old.write_bytes(subprocess.run(["git", "show", f"{baseline}:forge/kernels/q8_matmul.c"],
                                       capture_output=True, check=True).stdout)
        for march in marches:
            for label, src in ((baseline, old), ("now", source)):
                built = Path(tmp) / f"{label}-{march}.so"
                subprocess.run([shutil.which("cc") or "gcc", *flags, f"-march={march}", "-shared", "-I", tmp,
                                "-o", str(built), str(src), "-lm"], check=True, capture_output=True)
                lib = ctypes.CDLL(str(built))
                figures = []
                for n in (1, 8, 32, 64):
                    x = rng.standard_normal((n, cols)).astype(np.float32)
                    out = np.empty((n, rows), np.float32)
                    args = [ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(n), ctypes.c_int64(cols),
                            ctypes.c_void_p(blocks.ctypes.data), ctypes.c_int64(0), ctypes.c_int64(rows),
                            ctypes.c_int64(rows), ctypes.c_void_p(out.ctypes.data)]
                    figures.append(timed(lambda fn=lib.q8_0_matmul, args=args: fn(*args), reps) * 1e3)
                print(f"{march:>12s} {label:>12s}  " + "".join(f"{f:9.1f}" for f in figures))


def _int8_session(w_t: np.ndarray, per_row: bool) -> object:
    """x -> x @ W over int8 weights (per output column) and activations quantized to uint8 by
    onnxruntime (DynamicQuantizeMatMul: one scale per call), or per row: each row divided by its
    largest magnitude first, the product multiplied back."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from forge.kernels.onnx_linear import session_options

    k, n = w_t.shape
    scale = (np.abs(w_t).max(axis=0) / 127).astype(np.float32)
    scale[scale == 0] = 1
    q = np.clip(np.round(w_t / scale), -127, 127).astype(np.int8)
    arrays = {"wq": q, "ws": scale, "wz": np.zeros(n, np.int8), "ax": np.array([1], np.int64),
              "tiny": np.array(1e-30, np.float32)}
    inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    node = helper.make_node
    if per_row:
        nodes = [node("Abs", ["x"], ["a"]), node("ReduceMax", ["a", "ax"], ["m0"], keepdims=1),
                 node("Max", ["m0", "tiny"], ["m"]), node("Div", ["x", "m"], ["xn"]),
                 node("DynamicQuantizeMatMul", ["xn", "wq", "ws", "wz"], ["yn"], domain="com.microsoft"),
                 node("Mul", ["yn", "m"], ["y"])]
    else:
        nodes = [node("DynamicQuantizeMatMul", ["x", "wq", "ws", "wz"], ["y"], domain="com.microsoft")]
    graph = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])], inits)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                    helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(2), providers=["CPUExecutionProvider"])


def cmd_int8(model: str | None, reps: int) -> None:
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from forge.config import EngineConfig
    from tests.reference_cases import greedy_agrees, run_reference

    configure_matmul("split", 2)
    loaded = LoadedModel.load(model, kernels="amx", progress=lambda _m: None)
    weights = loaded.model.weights
    linears = [w for layer in weights.layers for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    assert all(isinstance(w, OnnxLinear) and w.dense_rows for w in linears), "needs the AMX kernels"

    def w_t(linear: OnnxLinear) -> np.ndarray:      # W [K, N], exactly, through onnxruntime's float32 path
        return linear._session.run(None, {"x": np.eye(linear.in_features, dtype=np.float32)})[0]

    sessions = {v: {id(w): _int8_session(w_t(w), v == "int8 per row") for w in linears}
                for v in ("int8 per tensor", "int8 per row")}
    pool = active_pool()
    rng = np.random.default_rng(0)
    first = linears[:4]
    print("one layer's four products, ms (median of calls):")
    print("rows   onnxruntime   amx bf16x3   int8 per tensor   int8 per row")
    for rows in (64, 128, 512):
        xs = {k: rng.standard_normal((rows, k)).astype(np.float32) for k in {w.in_features for w in first}}
        figures = [timed(lambda xs=xs: [w._session.run(None, {"x": xs[w.in_features]}) for w in first], reps),
                   timed(lambda xs=xs: [pool.matmul(xs[w.in_features], w) for w in first], reps)]
        for variant in sessions:
            figures.append(timed(lambda v=variant, xs=xs: [sessions[v][id(w)].run(None, {"x": xs[w.in_features]})
                                                           for w in first], reps))
        print(f"{rows:4d}   " + "   ".join(f"{f * 1e3:10.2f}" for f in figures))
    data = json.loads((Path(__file__).resolve().parents[2] / "tests/data/smollm2_reference.json").read_text())
    print("\nthe reference data, steps of 64+ rows on each path:")
    print("path              greedy (to first near-tie)   max top-5 logprob error")
    original = OnnxLinear.matmul
    for variant in ("amx bf16x3", *sessions):
        def patched(self: OnnxLinear, x: np.ndarray, variant: str = variant) -> np.ndarray:
            if variant in sessions and x.shape[0] >= 64:
                return sessions[variant][id(self)].run(None, {"x": np.ascontiguousarray(x, np.float32)})[0]
            return original(self, x)
        OnnxLinear.matmul = patched  # type: ignore[method-assign]
        for w in linears:               # through matmul(), not the pool's column split
            w.dense_rows = None if variant in sessions else w.dense_rows
        outputs, _ = run_reference(loaded, data, EngineConfig(
            kv_cache_memory=512 * 2**20, max_model_len=512, kernels="amx",
            max_num_seqs=len(data["greedy"]) + len(data["logprobs"]), max_num_batched_tokens=2048))
        matched = sum(greedy_agrees(case, outputs[f"greedy-{i}"][0]) for i, case in enumerate(data["greedy"]))
        worst = max((abs(dict(outputs[f"logprobs-{i}"][1][0].top_logprobs)[int(t)] - float(lp))
                     for i, case in enumerate(data["logprobs"]) for t, lp in case["top5"]
                     if int(t) in dict(outputs[f"logprobs-{i}"][1][0].top_logprobs)), default=0.0)
        print(f"{variant:16s}  {matched:3d} / {len(data['greedy']):<3d}                    {worst:.2e}")
    OnnxLinear.matmul = original  # type: ignore[method-assign]


def cmd_layers(tokens: list[int], rounds: int, numerics: list[str], threads_list: list[int], isa: str = "native",
               clock: str = "wall") -> None:
    """The blocks kernel on eight layers of the 1.7B model's shapes (random Q4_K q/k/v, o and
    gate/up, Q6_K down: 337 MB, ten times the L3 cache), per step size and numerics (reference:
    float32; fast: bfloat16 products; deterministic: qmatmul_det.c on its packed layout;
    deterministic-file: the same from the file's blocks), on 1 and 2 threads, beside a 1 GiB copy on
    the same threads: bytes of weights read per second, rows x that, and the multiply-adds per second.
    `isa`: the build level (compiled.library_at; native: the process's); `clock`: wall, or cpu (the
    process's CPU time: steadier on a loaded machine, but it counts the pool's idle spinning too)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from forge.kernels import compiled, products

    lib = compiled.library() if isa == "native" else compiled.library_at(isa)
    now = time.process_time if clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(0)

    def blocks(qtype: GGMLQuantizationType, rows: int, k: int) -> np.ndarray:
        elems, nbytes = GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(rows * k // elems, nbytes), dtype=np.uint8)
        for off in ([0, 2] if qtype == GGMLQuantizationType.Q4_K else [208]):   # sane float16 scales
            data[:, off:off + 2] = rng.uniform(0.001, 0.02, len(data)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        return data.reshape(rows, -1)

    q4k, q6k = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
    layers = [(products.qparts([(b, int(t))]), b, k) for _ in range(8)
              for b, t, k in ((blocks(q4k, 6144, 2048), q4k, 2048), (blocks(q4k, 2048, 2048), q4k, 2048),
                              (blocks(q4k, 16384, 2048), q4k, 2048), (blocks(q6k, 2048, 8192), q6k, 8192))]
    # The deterministic numerics read their own packed copy of each weight, as a model loaded in them does.
    packed = [products.qparts_rows([(*products.det_pack(b, int(desc[0].type), k, lib=lib), b.shape[0])])
              if "deterministic" in numerics else None for desc, b, k in layers]
    total = sum(b.nbytes for _, b, _ in layers)
    src = np.ones(1 << 30, dtype=np.uint8)
    dst = np.zeros_like(src)
    macs = sum(b.shape[0] * k for _, b, k in layers)
    for threads in threads_list:
        products.pool_threads(threads, lib=lib)
        products.parallel_copy(dst, src)
        t0 = time.perf_counter()
        products.parallel_copy(dst, src)
        print(f"threads={threads}: 1 GiB copy reads {src.size / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
        for t in tokens:
            xs = {k: rng.standard_normal((t, k)).astype(np.float32) for k in (2048, 8192)}
            best = {mode: float("inf") for mode in numerics}
            for _ in range(rounds):
                for mode in numerics:                    # alternating, so drift hits both alike
                    t0 = now()
                    for (desc, b, k), det_desc in zip(layers, packed, strict=True):
                        out = np.empty((t, b.shape[0]), dtype=np.float32)
                        if mode == "deterministic":
                            assert det_desc is not None
                            products.qmatmul_det(xs[k], k, det_desc, out, lib=lib)
                        elif mode == "deterministic-file":
                            products.qmatmul_det(xs[k], k, desc, out, lib=lib)
                        else:
                            products.qmatmul(xs[k], k, desc, out, lib=lib, fast=mode == "fast")
                    best[mode] = min(best[mode], now() - t0)
            for mode, s in best.items():
                print(f"threads={threads} rows={t:4d} {mode:9s}: {s * 1e3:7.1f} ms for {total / 1e6:.0f} MB of "
                      f"weights, {total / s / 1e9:5.1f} GB/s, x rows {t * total / s / 1e9:6.1f} GB/s, "
                      f"{2 * t * macs / s / 1e9:6.1f} GFLOP/s")


def cmd_bandwidth(model: str | None, kernels: str, rounds: int) -> None:
    """One decoding row's products (all layers + the head) as a share of this host's memory
    bandwidth, both measured in this run, alternating: the bandwidth as a 1 GiB copy on the
    kernels' threads (bytes read per second), the products as the weights' bytes read per second."""
    from forge.kernels import products

    loaded = LoadedModel.load(model, kernels=kernels, progress=lambda _m: None)
    weights = loaded.model.weights
    products.pool_threads(2)
    src = np.ones(1 << 30, dtype=np.uint8)
    dst = np.zeros_like(src)
    copies, rates = [], []
    for _ in range(rounds):
        products.parallel_copy(dst, src)
        t0 = time.perf_counter()
        products.parallel_copy(dst, src)
        copies.append(src.size / (time.perf_counter() - t0))
        s = matmul_seconds(weights, 1, num_head_rows=1, min_time_s=0.5, min_reps=3)
        rates.append(weights.nbytes / s)
    bw, rate = statistics.median(copies), statistics.median(rates)
    print(f"model {loaded.model.config.name} ({kernels}): weights {weights.nbytes / 2**20:.0f} MiB")
    print(f"memory bandwidth (1 GiB copy, 2 threads, bytes read): {bw / 1e9:.1f} GB/s "
          f"(rounds: {', '.join(f'{c / 1e9:.1f}' for c in copies)})")
    print(f"one decoding row's products: {rate / 1e9:.1f} GB/s of weights = {rate / bw:.0%} of the bandwidth, "
          f"{weights.nbytes / rate * 1e3:.1f} ms a token (rounds: {', '.join(f'{p / 1e9:.1f}' for p in rates)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", default="products",
                        choices=["products", "attention", "head", "head-march", "int8", "bandwidth", "layers"])
    parser.add_argument("--march", default="x86-64-v3,native", help="head-march: -march values, comma-separated")
    parser.add_argument("--baseline", default="257b046", help="head-march: the revision to compare with")
    parser.add_argument("--reps", type=int, default=20, help="attention, head: timed calls per figure")
    parser.add_argument("--model", default=None)
    parser.add_argument("--kernels", default="numpy,onnxruntime,fast")
    parser.add_argument("--tokens", default="1,8,32,128")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--head-rows", type=int, default=None,
                        help="products: rows through the head per step (default: all; a prefill step samples 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--numerics", default="reference",
                        help="layers: reference,fast (the blocks kernel's float32 or bfloat16 products)")
    parser.add_argument("--layer-threads", default="1,2", help="layers: thread counts, comma-separated")
    parser.add_argument("--isa", default="native", help="layers: the build level (FORGE_KERNEL_ISA's names)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="layers: wall or the process's CPU time")
    parser.add_argument("--kv-dtypes", default="float32,float16,int8", help="attention: K/V storage types")
    parser.add_argument("--context", type=int, default=200, help="attention: keys per sequence")
    parser.add_argument("--shape", default="135m", choices=["135m", "1.7b"], help="attention: the model's heads")
    args = parser.parse_args()
    if args.case == "attention":
        cmd_attention(args.reps, args.kv_dtypes.split(","), args.context, args.shape)
        return
    if args.case == "head":
        cmd_head(args.model, args.reps)
        return
    if args.case == "int8":
        cmd_int8(args.model, args.reps)
        return
    if args.case == "layers":
        cmd_layers([int(t) for t in args.tokens.split(",")], args.rounds, args.numerics.split(","),
                   [int(t) for t in args.layer_threads.split(",")], args.isa, args.clock)
        return
    if args.case == "bandwidth":
        cmd_bandwidth(args.model, args.kernels.split(",")[0], args.rounds)
        return
    if args.case == "head-march":
        cmd_head_march(args.model, args.reps, args.march.split(","), args.baseline)
        return
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
                head_rows = t if args.head_rows is None else min(t, args.head_rows)
                s = matmul_seconds(model.model.weights, t, num_head_rows=head_rows, min_time_s=0.3, min_reps=2)
                rates.setdefault((name, t), []).append(t / s)
    head = "the head on every row" if args.head_rows is None else f"the head on {args.head_rows} row(s)"
    print(f"\nmatmul-only tokens/s (median of rounds), all layers + {head}, tokens per step:")
    print("tokens " + "".join(f"{name:>14s}" for name in loaded))
    for t in tokens:
        print(f"{t:6d} " + "".join(f"{statistics.median(rates[(n, t)]):14.1f}" for n in loaded))
    print(f"\npeak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
