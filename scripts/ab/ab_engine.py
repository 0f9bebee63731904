"""Paired A/B measurements of engine choices, old and new alternating inside one process.

On a shared VM the noise between runs (up to 30%) is larger than most single changes, so each case
here runs both variants back to back, many times, and reports medians and the median of the
per-pair ratios. Not part of forge and not run by tests: the commands behind the figures in
docs/benchmarks.md ("Tried since").

    .venv/bin/python scripts/ab/ab_engine.py load        # start-up: header, tokenizer, dequantize
    .venv/bin/python scripts/ab/ab_engine.py rows        # row-parallel layers vs the column split
    .venv/bin/python scripts/ab/ab_engine.py one-row     # one decoding sequence: split matmuls, KV in place
    .venv/bin/python scripts/ab/ab_engine.py matvec      # each one-row projection whole vs split
    .venv/bin/python scripts/ab/ab_engine.py pool        # the pool's hand-off vs a futures executor
    .venv/bin/python scripts/ab/ab_engine.py attention   # one layer's decode attention, piece by piece
    .venv/bin/python scripts/ab/ab_engine.py kv-commit   # prefill steps on blocks never written before,
                                                         # the KV cache committed at start or not
    .venv/bin/python scripts/ab/ab_engine.py prefill-kernels  # whole prefill steps: compiled attention,
                                                         # norms, SiLU and the split on two threads, or numpy
    .venv/bin/python scripts/ab/ab_engine.py burst       # the floor under the first pass's first tokens: the
                                                         # bench workload's first 32 prompts, prefill only
    .venv/bin/python scripts/ab/ab_engine.py guesses     # one layer's attention of decode rows with their
                                                         # guesses: decode kernel row by row, or prefill kernel
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import forge.models.llama.kv_cache as kv_cache  # noqa: E402
import forge.models.llama.linear as linear_mod  # noqa: E402
import forge.models.llama.llama_model as model_mod  # noqa: E402
from forge.models.forward_batch import ForwardBatch  # noqa: E402
from forge.models.hub import default_model_path  # noqa: E402
from forge.models.llama.llama_model import LlamaModel  # noqa: E402

DEFAULT_MODEL = default_model_path()
BLOCK_SIZE = 16


def batch_for(num_tokens: int, num_seqs: int, context: int = 0) -> ForwardBatch:
    """num_seqs sequences of num_tokens // num_seqs new tokens each after `context` cached ones,
    on consecutive blocks (sequence s on blocks s * nb ...)."""
    per = num_tokens // num_seqs
    nb = -(-(context + per) // BLOCK_SIZE)
    tokens, positions, slots, starts, lens, tables = [], [], [], [0], [], []
    for s in range(num_seqs):
        table = list(range(s * nb, (s + 1) * nb))
        pos = list(range(context, context + per))
        tokens += [100 + p % 500 for p in pos]
        positions += pos
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
        starts.append(starts[-1] + per)
        lens.append(context + per)
        tables.append(table)
    a = np.array
    return ForwardBatch(a(tokens), a(positions), a(slots), a(starts), a(lens), a(tables),
                        a([starts[i + 1] - 1 for i in range(num_seqs)]))


def paired(cases: dict[str, Callable[[], Any]], variants: dict[str, Callable[[], None]], reps: int) -> None:
    """For each case: run it under every variant (set-up callables), order alternating per rep;
    print medians and the median ratio of each variant to the first."""
    names = list(variants)
    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(reps):
        for case, run in cases.items():
            for name in (names if rep % 2 == 0 else names[::-1]):
                variants[name]()
                started = time.perf_counter()
                run()
                times.setdefault((case, name), []).append(time.perf_counter() - started)
    for case in cases:
        base = times[(case, names[0])]
        cols = [f"{n} {statistics.median(times[(case, n)]) * 1e3:8.1f} ms" for n in names]
        medians = {n: statistics.median([b / a for a, b in zip(base, times[(case, n)], strict=True)])
                   for n in names[1:]}
        ratios = [f"{n}/{names[0]} {ratio:.3f}" for n, ratio in medians.items()]
        print(f"{case:18s} " + "  ".join(cols + ratios))


def cmd_load(model: Path, reps: int) -> None:
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from forge.llm import LoadedModel
    from forge.models.gguf_file import read_gguf
    from forge.models.llama.dequant import dequantize
    from forge.text.tokenizer import Tokenizer

    def timed(fn: Callable[[], Any]) -> float:
        return min(_once(fn) for _ in range(reps))

    reader = read_gguf(model)
    tensors = list(reader.tensors.values())
    print(f"gguf.GGUFReader       {timed(lambda: gguf.GGUFReader(model)):.2f} s")
    print(f"forge read_gguf       {timed(lambda: read_gguf(model)):.2f} s")
    print(f"tokenizer             {timed(lambda: Tokenizer.from_gguf(reader)):.2f} s")
    print(f"gguf dequantize       {timed(lambda: [gguf_dequantize(t.data, t.tensor_type) for t in tensors]):.2f} s")
    print(f"forge dequantize      {timed(lambda: [dequantize(t.data, t.tensor_type) for t in tensors]):.2f} s")
    print(f"LoadedModel.load      {timed(lambda: LoadedModel.load(model, progress=lambda _m: None)):.2f} s")


def _once(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _model(path: Path) -> tuple[LlamaModel, Any]:
    model = LlamaModel.load(path)
    linear_mod.configure_matmul("split", 2)
    return model, model.new_kv_cache(2600, BLOCK_SIZE)


def cmd_rows(model_path: Path, reps: int) -> None:
    model, kv = _model(model_path)
    cases = {f"{t}x{s}@{c}": functools.partial(model.forward, batch_for(t, s, c), kv)
             for t, s, c in ((64, 1, 100), (256, 1, 100), (480, 4, 100), (512, 1, 0), (1000, 1, 0))}
    paired(cases, {"column": lambda: setattr(model_mod, "MIN_ROW_SPLIT_TOKENS", 1 << 62),
                   "rows": lambda: setattr(model_mod, "MIN_ROW_SPLIT_TOKENS", 256)}, reps)


def cmd_one_row(model_path: Path, reps: int) -> None:
    model, kv = _model(model_path)
    cases = {f"decode1@{c}": functools.partial(model.forward, batch_for(1, 1, c), kv) for c in (300, 1000)}
    cases["prefill512@1000"] = functools.partial(model.forward, batch_for(512, 1, 1000), kv)
    in_place = kv_cache.Scratch.gather

    def copy(self: kv_cache.Scratch, slot: int, cache: Any, block_ids: Any) -> Any:
        out = self.get(slot, (*block_ids.shape, *cache.shape[1:]))
        return np.take(cache, block_ids, axis=0, out=out, mode="clip")

    def variant(split_few_rows: int, gather: Any) -> Callable[[], None]:
        def set_up() -> None:
            linear_mod.MIN_SPLIT_MACS_FEW_ROWS = split_few_rows
            kv_cache.Scratch.gather = gather  # type: ignore[method-assign]
        return set_up

    paired(cases, {"whole+copy": variant(1 << 62, copy), "split+copy": variant(1 << 20, copy),
                   "split+in-place": variant(1 << 20, in_place)}, reps)


def cmd_matvec(model_path: Path, reps: int) -> None:
    model, _ = _model(model_path)
    w, layers = model.weights, model.weights.layers
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, w.embedding.shape[1])).astype(np.float32)
    f = rng.standard_normal((1, layers[0].w_down.shape[0])).astype(np.float32)
    mats = {"qkv": (x, [la.wqkv for la in layers]), "wo": (x, [la.wo for la in layers]),
            "gate_up": (x, [la.w_gate_up for la in layers]), "down": (f, [la.w_down for la in layers]),
            "head": (x, [w.head])}
    cases = {name: (lambda xi=xi, ws=ws: [linear_mod.matmul(xi, wi) for wi in ws]) for name, (xi, ws) in mats.items()}
    paired(cases, {"whole": lambda: setattr(linear_mod, "MIN_SPLIT_MACS_FEW_ROWS", 1 << 62),
                   "split": lambda: setattr(linear_mod, "MIN_SPLIT_MACS_FEW_ROWS", 0)}, reps)


def cmd_pool(reps: int) -> None:
    executor = ThreadPoolExecutor(1)
    pool = linear_mod.MatmulPool("split", 2)

    def noop(_: object = None) -> None:
        pass

    def via_executor(fn: Callable[[object], None]) -> Callable[[], None]:
        def run() -> None:
            future = executor.submit(fn, None)
            fn(None)
            future.result()
        return run

    def via_pool(fn: Callable[[object], None]) -> Callable[[], None]:
        return lambda: pool.run_parts(fn, [None, None])

    with threadpool_limits(1):
        n = 2000
        for label, make in (("executor", via_executor), ("forge pool", via_pool)):
            run = make(noop)
            for _ in range(100):
                run()
            seconds = min(_once(lambda run=run: [run() for _ in range(n)]) for _ in range(reps)) / n
            print(f"{label:11s} {seconds * 1e6:6.1f} us per hand-off round trip (empty parts)")
    executor.shutdown()
    pool.close()


def cmd_attention(reps: int) -> None:
    """One layer's decode attention at 32 sequences x 208 keys (SmolLM2's 3 KV heads of 64, groups
    of 3), single-threaded, split into its numpy pieces."""
    num_seqs, num_keys, nkv, hd, group = 32, 208, 3, 64, 3
    nb = num_keys // BLOCK_SIZE
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((num_seqs * nb + 8, BLOCK_SIZE, nkv, hd), dtype=np.float32)
    tables = (rng.permutation(num_seqs * nb) + 1).reshape(num_seqs, nb)
    q = rng.standard_normal((num_seqs, nkv, group, hd), dtype=np.float32)
    keys_buf = np.empty((num_seqs, nb, BLOCK_SIZE, nkv, hd), np.float32)
    keys = keys_buf.reshape(num_seqs, num_keys, nkv, hd)
    scores = np.empty((num_seqs, nkv, group, num_keys), np.float32)

    def softmax() -> None:
        s = scores.copy()
        s -= s.max(-1, keepdims=True)
        np.exp(s, out=s)
        s.sum(-1, keepdims=True)

    pieces = {
        "gather K (take)": lambda: np.take(cache, tables, axis=0, out=keys_buf, mode="clip"),
        "q K^T (96 matmuls)": lambda: np.matmul(q, keys.transpose(0, 2, 3, 1), out=scores),
        "softmax": softmax,
        "P V (96 matmuls)": lambda: np.matmul(scores, keys.transpose(0, 2, 1, 3)),
    }
    count = 100
    with threadpool_limits(1):
        for name, fn in pieces.items():
            fn()
            seconds = min(_once(lambda fn=fn: [fn() for _ in range(count)]) for _ in range(reps)) / count
            print(f"{name:20s} {seconds * 1e3:6.3f} ms per layer (V is gathered like K)")


def cmd_kv_commit(model_path: Path, reps: int) -> None:
    """Two offline engines over one model, both alive, one with its KV cache committed at start
    (EngineConfig.kv_cache_commit), one not; 511-token prompts alternate between them, one step
    each, every prompt on blocks its engine has not written before (the prefix cache hands out
    unused blocks first). Prints each engine's step times and their medians."""
    from forge.config import EngineConfig
    from forge.llm import LLM, LoadedModel
    from forge.sampling.sampling_params import SamplingParams

    loaded = LoadedModel.load(model_path, progress=lambda _m: None)
    budget = (reps + 1) * 512 * 46080                 # every prompt on fresh blocks (45 KiB a token)
    engines = {}
    for commit in (False, True):
        started = time.perf_counter()
        engines[commit] = LLM.from_loaded(loaded, EngineConfig(kv_cache_memory=budget, max_model_len=1024,
                                                                kv_cache_commit=commit)).engine
        print(f"commit={commit}: built in {time.perf_counter() - started:.2f} s")
    rng = np.random.default_rng(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(reps):
        for commit, engine in (engines.items() if i % 2 == 0 else reversed(engines.items())):
            engine.add_request(f"p{i}", rng.integers(3, 40000, 511).tolist(), SamplingParams(max_tokens=1))
            started = time.perf_counter()
            engine.step()
            times[commit].append(time.perf_counter() - started)
            while engine.has_work():
                engine.step()
    for commit, steps in times.items():
        print(f"commit={commit}: 511-token prefill steps {statistics.median(steps) * 1e3:7.1f} ms median  "
              + " ".join(f"{t * 1e3:.0f}" for t in steps))


def cmd_prefill_kernels(model_path: Path, reps: int) -> None:
    """Whole prefill forwards on the default kernels (AMX products here), the step's other work on
    the compiled kernels (prompt attention, RMSNorm, gated SiLU) or on numpy, alternating."""
    from forge.kernels import choose_kernels

    model = LlamaModel.load(model_path, kernels=choose_kernels("auto"))
    linear_mod.configure_matmul("split", 2)
    kv = model.new_kv_cache(2600, BLOCK_SIZE)
    kv.k.fill(0.0)
    kv.v.fill(0.0)                                    # every page written before timing

    def use(compiled_rest: bool) -> Callable[[], None]:
        def set_up() -> None:
            model.compiled_ops = compiled_rest
        return set_up

    cases = {f"{t}x{s}": functools.partial(model.forward, batch_for(t, s), kv)
             for t, s in ((512, 1), (1000, 1), (800, 4), (256, 1))}
    paired(cases, {"numpy": use(False), "compiled": use(True)}, reps)


def cmd_guesses(reps: int) -> None:
    """One layer's attention (SmolLM2's 9 query heads on 3 KV heads of 64, one thread) for 32
    sequences of ~300 or ~800 keys, each computing 1, 2, 5 or 9 rows (a decode row and its
    speculative guesses), blocks scattered: chunks of up to 8 rows on the decode kernel row by row
    (as before), or every chunk of 2+ rows on the prefill kernel (now)."""
    from types import SimpleNamespace

    from forge.models.llama import attention, attention_plan
    from forge.models.llama.kv_cache import Scratch

    rng = np.random.default_rng(0)
    config = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    linear_mod.configure_matmul("split", 1)
    for keys, rows in ((300, 1), (300, 2), (300, 3), (300, 4), (800, 3), (300, 5), (800, 5), (300, 9)):
        lens = [keys + int(rng.integers(0, 50)) for _ in range(32)]
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 2
        free = rng.permutation(num_blocks)
        tables = np.zeros((32, max(-(-n // BLOCK_SIZE) for n in lens)), dtype=np.int64)
        used = 0
        for s, n in enumerate(lens):
            nb = -(-n // BLOCK_SIZE)
            tables[s, :nb] = free[used:used + nb]
            used += nb
        positions = np.concatenate([np.arange(n - rows, n) for n in lens])
        starts = np.arange(33, dtype=np.int64) * rows
        batch = ForwardBatch(np.zeros(len(positions), np.int64), positions, np.zeros(len(positions), np.int64),
                             starts, np.array(lens), tables, starts[1:] - 1)
        k = rng.standard_normal((num_blocks, BLOCK_SIZE, 3, 64), dtype=np.float32)
        v = rng.standard_normal((num_blocks, BLOCK_SIZE, 3, 64), dtype=np.float32)
        q = rng.standard_normal((len(positions), 9, 64), dtype=np.float32) / 8
        scratch = Scratch()

        def run(batch: ForwardBatch = batch, k: Any = k, v: Any = v, q: Any = q, scratch: Scratch = scratch) -> None:
            attention.attend(attention_plan.plan_attention(batch, config, BLOCK_SIZE, 1, fused=True), q, k, v, scratch)

        def rows_up_to(n: int) -> Callable[[], None]:
            return lambda: setattr(attention_plan, "MAX_DECODE_KERNEL_ROWS", n)

        print(f"32 x {rows} rows, ~{keys} keys:", end=" ")
        sys.stdout.flush()
        paired({"one layer": run}, {"decode kernel": rows_up_to(8), "prefill kernel": rows_up_to(1)}, reps)
    attention_plan.MAX_DECODE_KERNEL_ROWS = 1


def cmd_burst(model_path: Path, reps: int) -> None:
    """The first 32 prompts of `forge bench`'s mixed workload (its first pass at 32 streams), all
    at once into an offline engine with forge serve's defaults, one output token each: the time to
    the last first token with nothing decoding, a floor under the first pass's TTFT p99. A fresh
    engine (cold prefix cache) per repeat, the KV cache committed before timing."""
    from forge.config import EngineConfig
    from forge.llm import LLM, LoadedModel
    from forge.sampling.sampling_params import SamplingParams
    from forge_bench import loadgen

    loaded = LoadedModel.load(model_path, progress=lambda _m: None)
    workload = loadgen.build_workload(loaded.tokenizer, num_requests=96, max_tokens=128, seed=0)
    prompts = [item.prompt for item in workload.items[:32]]
    for _ in range(reps):
        llm = LLM.from_loaded(loaded, EngineConfig(max_num_seqs=32, kv_cache_commit=True, max_step_ms=350.0))
        started = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        wall = time.perf_counter() - started
        total = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        print(f"{len(prompts)} prompts, {total} tokens ({total - cached} computed, {cached} from the prefix "
              f"cache): last first token after {wall:.2f} s ({(total - cached) / wall:.0f} computed tok/s)")


# case: (its command, whether it takes --model, its default --reps)
CASES: dict[str, tuple[Callable[..., None], bool, int]] = {
    "load": (cmd_load, True, 3), "rows": (cmd_rows, True, 4), "one-row": (cmd_one_row, True, 16),
    "matvec": (cmd_matvec, True, 7), "pool": (cmd_pool, False, 3), "attention": (cmd_attention, False, 3),
    "kv-commit": (cmd_kv_commit, True, 10), "prefill-kernels": (cmd_prefill_kernels, True, 6),
    "burst": (cmd_burst, True, 3), "guesses": (cmd_guesses, False, 15),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=list(CASES))
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--reps", type=int, default=None, help="pairs per case (default depends on the case)")
    args = ap.parse_args()
    run, takes_model, default_reps = CASES[args.case]
    reps = args.reps or default_reps
    if takes_model:
        run(args.model, reps)
    else:
        run(reps)


if __name__ == "__main__":
    main()
