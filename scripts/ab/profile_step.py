"""Time forge's engine step on the real model, part by part, against its matmuls alone.

Builds an LLMEngine on a GGUF model and times decode steps at several batch sizes (every sequence
decoding at about --context tokens) and prefill steps, split into matmuls, attention, norms/rope/
activation, sampling, batch building and the rest; then times the same matmuls alone for the same
token count. Not part of forge and not run by tests: a measuring tool.

    .venv/bin/python scripts/ab/profile_step.py --matmul blas:1 blas:2 split:2 --seqs 1 8 32 64
    .venv/bin/python scripts/ab/profile_step.py --matmul blas:2 split:2 --spinners 1   # under a competing load

The decode set-up skips the real prefill (it would take minutes): a stub forward fills the K/V
slots with random values, then the real model decodes. Other jobs on the machine skew every
figure: the load average is printed, and each figure is the median over --steps steps. --spinners N
starts N busy-looping processes for the run (killed at the end) to measure under a competing load.
Steps run on the column-split path (the row-parallel path of 256+ token steps is not split into parts).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import forge.engine.model_runner as runner_mod  # noqa: E402
import forge.models.llama.llama_model as model_mod  # noqa: E402
import forge.models.llama.rope as rope_mod  # noqa: E402
from forge.config import EngineConfig  # noqa: E402
from forge.llm import LLMEngine, LoadedModel  # noqa: E402
from forge.models.hub import default_model_path  # noqa: E402
from forge.models.llama.kv_cache import KVCache  # noqa: E402
from forge.models.llama.kv_dtype import to_storage  # noqa: E402
from forge.models.llama.linear import matmul  # noqa: E402
from forge.sampling.sampling_params import SamplingParams  # noqa: E402

DEFAULT_MODEL = default_model_path()
det_mod: Any = getattr(model_mod, "det_forward", None)      # code before the deterministic row-wise operations: None

# Names in forge.models.llama.llama_model timed as one part each; missing ones (older code) are skipped.
FORWARD_PARTS = {
    "matmul": "matmul", "attend": "attention", "plan_attention": "attention", "write_kv": "attention",
    "rms_norm": "norm/rope/act", "apply_rope": "norm/rope/act", "swiglu": "norm/rope/act",
    "rms_norm_compiled": "norm/rope/act", "swiglu_compiled": "norm/rope/act", "gelu_tanh_gated": "norm/rope/act",
    "apply_rope_exact": "norm/rope/act",
    "check_batch": "checks",
}
# The deterministic numerics' row-wise operations, in forge.models.llama.det_forward where the code has it.
DET_PARTS = {"rms_norm": "norm/rope/act", "gated": "norm/rope/act"}
COLUMNS = ["matmul", "attention", "norm/rope/act", "fwd other", "sampling", "batch build", "runner other",
           "core"]


# The clock every figure uses: wall time, or this process's CPU time (--clock cpu), which other jobs
# on the machine disturb less (only meaningful with 1 BLAS thread: idle BLAS threads may spin).
clock: Callable[[], float] = time.perf_counter


class Timers:
    """Accumulates seconds per part; wraps module functions while active."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[part] += clock() - started
        return timed

    def take(self) -> dict[str, float]:
        acc, self.acc = dict(self.acc), defaultdict(float)
        return acc


def install(engine: LLMEngine, timers: Timers) -> None:
    for name, part in FORWARD_PARTS.items():
        if hasattr(model_mod, name):
            setattr(model_mod, name, timers.wrap(part, getattr(model_mod, name)))
    for name, part in DET_PARTS.items():
        if det_mod is not None and hasattr(det_mod, name):
            setattr(det_mod, name, timers.wrap(part, getattr(det_mod, name)))
    rope_mod.RopeTables.at = timers.wrap("norm/rope/act", rope_mod.RopeTables.at)  # type: ignore[method-assign]
    runner_mod.build_forward_batch = timers.wrap("batch build", runner_mod.build_forward_batch)
    runner = engine.runner
    runner.model.forward = timers.wrap("forward", runner.model.forward)  # type: ignore[method-assign]
    runner.sampler.sample = timers.wrap("sampling", runner.sampler.sample)  # type: ignore[method-assign]
    runner.execute = timers.wrap("execute", runner.execute)  # type: ignore[method-assign]


def breakdown(acc: dict[str, float], step_s: float) -> dict[str, float]:
    """Per-part seconds of one step; without a `matmul` hook the matmuls are the forward's rest."""
    fwd = acc.get("forward", 0.0)
    inner = sum(acc.get(p, 0.0) for p in ("attention", "norm/rope/act", "checks"))
    out = {
        "attention": acc.get("attention", 0.0),
        "norm/rope/act": acc.get("norm/rope/act", 0.0),
        "sampling": acc.get("sampling", 0.0),
        "batch build": acc.get("batch build", 0.0),
        "runner other": acc.get("execute", 0.0) - fwd - acc.get("sampling", 0.0) - acc.get("batch build", 0.0),
        "core": step_s - acc.get("execute", 0.0),
    }
    if "matmul" in acc:
        out["matmul"] = acc["matmul"]
        out["fwd other"] = fwd - inner - acc["matmul"] + acc.get("checks", 0.0)
    else:
        out["matmul"] = fwd - inner
        out["fwd other"] = acc.get("checks", 0.0)
    return out


class StubForward:
    """Stands in for the model during set-up: random K/V into the slots, random logits."""

    def __init__(self, kv: KVCache, vocab_size: int, seed: int) -> None:
        self.kv, self.vocab_size, self.rng = kv, vocab_size, np.random.default_rng(seed)

    def __call__(self, batch: Any, _kv: Any) -> np.ndarray:
        for cache in (self.kv.k, self.kv.v):
            flat = cache.reshape(cache.shape[0], -1, *cache.shape[3:])                 # [L, slots, nkv, hd]
            fill = self.rng.standard_normal((cache.shape[0], batch.num_tokens, *cache.shape[3:]))
            flat[:, batch.slot_mapping] = to_storage(fill.astype(np.float32), cache.dtype)
        return self.rng.standard_normal((len(batch.sample_indices), self.vocab_size)).astype(np.float32)


KV_DTYPE = "float32"   # --kv-cache-dtype
KV_COMMIT = False      # --kv-cache-commit


def make_engine(loaded: LoadedModel, mode: tuple[str, int], num_seqs: int, tokens_per_seq: int,
                budget: int) -> LLMEngine:
    mc = loaded.model.config
    block_size = 16
    blocks = num_seqs * (-(-tokens_per_seq // block_size) + 1) + 4
    config = EngineConfig(block_size=block_size, max_num_seqs=max(num_seqs, 1), max_num_batched_tokens=budget,
                          enable_prefix_caching=False, matmul_strategy=mode[0], blas_threads=mode[1],
                          kv_cache_memory=max(blocks, -(-mc.max_position // block_size))
                          * KVCache.bytes_per_block(mc, block_size, KV_DTYPE), kv_cache_dtype=KV_DTYPE,
                          kv_cache_commit=KV_COMMIT)
    return LLMEngine(loaded, config)


def sampling_params(args: argparse.Namespace, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=args.temperature,
                          top_p=args.top_p)


def decode_case(loaded: LoadedModel, args: argparse.Namespace, mode: tuple[str, int], num_seqs: int,
                rng: np.random.Generator) -> tuple[float, dict[str, float]]:
    steps = args.steps + 1
    engine = make_engine(loaded, mode, num_seqs, args.context + steps + 2, num_seqs * args.context + 16)
    vocab = loaded.model.config.vocab_size
    for i in range(num_seqs):
        prompt = rng.integers(3, vocab, args.context - 1).tolist()
        engine.add_request(f"r{i}", prompt, sampling_params(args, steps + 4))
    real_forward = engine.runner.model.forward
    engine.runner.model.forward = StubForward(engine.runner.kv, vocab, 0)  # type: ignore[method-assign]
    while any(r.seq.num_computed_tokens < len(r.seq.prompt) for r in engine.core._requests.values()):
        engine.step()
    engine.runner.model.forward = real_forward  # type: ignore[method-assign]
    timers = Timers()
    install(engine, timers)
    engine.step()  # warm-up: first real decode
    timers.take()
    totals, parts = [], defaultdict(list)
    for _ in range(args.steps):
        started = clock()
        engine.step()
        step_s = clock() - started
        totals.append(step_s)
        for k, v in breakdown(timers.take(), step_s).items():
            parts[k].append(v)
    restore()
    return statistics.median(totals), {k: statistics.median(v) for k, v in parts.items()}


def prefill_case(loaded: LoadedModel, args: argparse.Namespace, mode: tuple[str, int], num_prompts: int,
                 prompt_len: int, rng: np.random.Generator) -> tuple[float, dict[str, float]]:
    engine = make_engine(loaded, mode, num_prompts, prompt_len + 2, num_prompts * prompt_len)
    timers = Timers()
    install(engine, timers)
    vocab = loaded.model.config.vocab_size
    totals, parts = [], defaultdict(list)
    for rep in range(args.prefill_repeats):
        for i in range(num_prompts):
            engine.add_request(f"p{rep}-{i}", rng.integers(3, vocab, prompt_len).tolist(), sampling_params(args, 1))
        timers.take()
        started = clock()
        engine.step()
        step_s = clock() - started
        while engine.has_work():
            engine.step()
        totals.append(step_s)
        for k, v in breakdown(timers.take(), step_s).items():
            parts[k].append(v)
    restore()
    return statistics.median(totals), {k: statistics.median(v) for k, v in parts.items()}


_ORIGINALS: dict[tuple[Any, str], Any] = {}


def remember() -> None:
    for name in FORWARD_PARTS:
        if hasattr(model_mod, name):
            _ORIGINALS[(model_mod, name)] = getattr(model_mod, name)
    for name in DET_PARTS:
        if det_mod is not None and hasattr(det_mod, name):
            _ORIGINALS[(det_mod, name)] = getattr(det_mod, name)
    _ORIGINALS[(rope_mod.RopeTables, "at")] = rope_mod.RopeTables.at
    _ORIGINALS[(runner_mod, "build_forward_batch")] = runner_mod.build_forward_batch


def restore() -> None:
    for (owner, name), fn in _ORIGINALS.items():
        setattr(owner, name, fn)


def matmul_only(loaded: LoadedModel, num_tokens: int, num_sampled: int, repeats: int) -> float:
    """Median seconds of the step's matmuls alone (every layer plus the head), with forge's matmul()
    under the strategy the last engine set."""
    w, c = loaded.model.weights, loaded.model.config
    rng = np.random.default_rng(1)
    x = rng.standard_normal((num_tokens, c.hidden_size)).astype(np.float32)                 # [T, H]
    a = rng.standard_normal((num_tokens, c.num_heads * c.head_dim)).astype(np.float32)      # [T, nh*hd]
    f = rng.standard_normal((num_tokens, c.intermediate_size)).astype(np.float32)           # [T, F]
    times = []
    for _ in range(repeats + 1):
        started = clock()
        for layer in w.layers:
            matmul(x, layer.wqkv)
            matmul(a, layer.wo)
            matmul(x, layer.w_gate_up)
            matmul(f, layer.w_down)
        matmul(x[:num_sampled], w.head)
        times.append(clock() - started)
    return statistics.median(times[1:])


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def row(label: str, step_s: float, parts: dict[str, float], num_tokens: int, mm_s: float) -> str:
    cells = " ".join(f"{parts.get(c, 0.0) * 1e3:9.1f}" for c in COLUMNS)
    outside = 1.0 - parts.get("matmul", 0.0) / step_s
    return (f"{label:>12} {step_s * 1e3:9.1f} {num_tokens / step_s:7.1f} {cells} {outside:6.1%}"
            f" {mm_s * 1e3:8.1f} {num_tokens / mm_s:7.1f} {mm_s / step_s:6.1%}")


def main() -> None:
    # Time the column-split path on every step: a row-parallel step (256+ tokens) runs its matmuls and
    # norms inside the pool's parts, on two threads at once, where these per-function timers would
    # count both threads' time (its step time alone is comparable: see forge.models.llama.llama_model).
    model_mod.MIN_ROW_SPLIT_TOKENS = 1 << 62
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--matmul", nargs="+", default=["blas:1", "blas:2", "split:2"],
                    help="matmul modes STRATEGY:THREADS (EngineConfig.matmul_strategy, blas_threads)")
    ap.add_argument("--spinners", type=int, default=0, help="busy-looping processes to run alongside")
    ap.add_argument("--seqs", type=int, nargs="*", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=200, help="context length of the decoding sequences")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per case")
    ap.add_argument("--prefill", nargs="*", default=["4x200", "1x1000"],
                    help="prefill cases PROMPTSxLENGTH, each one step")
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--kv-cache-dtype", default="float32", help="how the K/V cache stores values")
    ap.add_argument("--kernels", default="auto", help="the kernel backend (forge.kernels.KERNELS)")
    ap.add_argument("--numerics", default="reference", help="reference or fast (forge.kernels.NUMERICS)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--kv-cache-commit", action="store_true",
                    help="write every page of each case's K/V cache before timing (as forge serve does), so "
                         "prefill steps do not pay first-touch page faults")
    args = ap.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    modes = [(m.split(":")[0], int(m.split(":")[1])) for m in args.matmul]
    loaded = LoadedModel.load(args.model, kernels=args.kernels, numerics=args.numerics, progress=lambda _m: None)
    global KV_DTYPE, KV_COMMIT
    KV_DTYPE, KV_COMMIT = args.kv_cache_dtype, args.kv_cache_commit
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
    try:
        run_cases(loaded, args, modes)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def run_cases(loaded: LoadedModel, args: argparse.Namespace, modes: list[tuple[str, int]]) -> None:
    remember()
    rng = np.random.default_rng(0)
    print(f"model {loaded.name}; clock {args.clock}; context {args.context}; "
          f"temperature {args.temperature}; spinners {args.spinners}; load average at start {load_average()}")
    head = " ".join(f"{c:>9}" for c in COLUMNS)
    print(f"{'case':>12} {'step ms':>9} {'tok/s':>7} {head} {'!mm':>6} {'mm-only':>8} {'mm tok/s':>7} {'ratio':>6}")
    print(f"{'':>12} {'':>9} {'':>7} " + " ".join(f"{'ms':>9}" for _ in COLUMNS))
    for mode in modes:
        print(f"--- matmul {mode[0]}, {mode[1]} thread(s) (load {load_average()})")
        for num_seqs in args.seqs:
            step_s, parts = decode_case(loaded, args, mode, num_seqs, rng)
            mm_s = matmul_only(loaded, num_seqs, num_seqs, args.steps)
            print(row(f"decode {num_seqs}", step_s, parts, num_seqs, mm_s), flush=True)
        for case in args.prefill:
            num_prompts, prompt_len = (int(v) for v in case.split("x"))
            step_s, parts = prefill_case(loaded, args, mode, num_prompts, prompt_len, rng)
            mm_s = matmul_only(loaded, num_prompts * prompt_len, num_prompts, 1)
            print(row(f"prefill {case}", step_s, parts, num_prompts * prompt_len, mm_s), flush=True)
    print(f"load average at end {load_average()}")
    print("columns: per-step medians; !mm = share of the step outside the matmuls; mm-only = the same "
          "matmuls alone (forge's matmul); ratio = mm-only / step (the engine's rate as a share of its matmuls')")


if __name__ == "__main__":
    main()
