"""Offline benchmark of the core with a real model (the toy engine's is forge.seed.toy_bench).

Figures only; nothing here asserts speed. The CLI prints them human-readable or as JSON. The
model bench also times the model's matmuls alone, the ceiling that the engine's rate is set against.
"""

from __future__ import annotations

import os
import random
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from forge.config import EngineConfig
from forge.llm import LLMEngine, LoadedModel
from forge.messages import StepBatch
from forge.models.llama import KVCache
from forge.models.llama.linear import configure_matmul, matmul
from forge.models.llama.weights import LlamaWeights
from forge.sampling.sampling_params import SamplingParams

# ---- the real model ---------------------------------------------------------------------------

Progress = Callable[[str], None]


def _quiet(message: str) -> None:
    pass


class _StepRecorder:
    """Notes each step's size, shape and time (LLMEngine.on_step; the engine loop is untouched)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, bool, float]] = []     # (tokens computed, is pure decode, seconds)

    def __call__(self, batch: StepBatch, seconds: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in batch.chunks)
        is_decode = bool(batch.chunks) and all(len(c.token_ids) == 1 for c in batch.chunks)
        self.steps.append((num_tokens, is_decode, seconds))


def _prompts(num: int, length: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    """Random ids of ordinary tokens, each prompt starting differently (no prefix is shared)."""
    low = min(1000, vocab_size // 4)
    return [[low + i] + [rng.randrange(low, vocab_size) for _ in range(length - 1)] for i in range(num)]


def _run_requests(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """All prompts at once, stepped to the end; wall time, first-token times and the step log."""
    recorder = engine.on_step = _StepRecorder()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", ids, params)
    first_token_s: dict[str, float] = {}
    num_output = 0
    while engine.has_work():
        for ev in engine.step():
            first_token_s.setdefault(ev.request_id, time.perf_counter() - t0)
            num_output += len(ev.token_ids)
    wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    engine.on_step = None
    decode = [(n, s) for n, is_decode, s in recorder.steps if is_decode]
    decode_tokens, decode_s = sum(n for n, _ in decode), sum(s for _, s in decode)
    ttft = sorted(first_token_s.values())
    return {
        "wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3), "output_tokens": num_output,
        "output_tokens_per_s": round(num_output / wall_s, 2),
        "steps": len(recorder.steps), "decode_steps": len(decode),
        "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else None,
        "ttft_p50_s": round(ttft[len(ttft) // 2], 3), "ttft_max_s": round(ttft[-1], 3),
        "preemptions": engine.core.stats().num_preemptions,
    }


def matmul_seconds(weights: LlamaWeights, num_tokens: int, *, num_head_rows: int, min_time_s: float = 0.5,
                   min_reps: int = 3) -> float:
    """Median time of one step's matmuls alone: x @ W for every layer's four matrices over
    `num_tokens` rows, and the head over `num_head_rows` rows, through the engine's own matmul
    (forge.models.llama.linear: same strategy and threads). No attention, norms or sampling."""
    rng = np.random.default_rng(0)
    hidden = weights.embedding.shape[1]
    dense = [layer for layer in weights.layers if layer.w_gate_up is not None and layer.w_down is not None]
    ffn = dense[0].w_down.shape[0] if dense and dense[0].w_down is not None else 1   # a mixture of experts: none
    x = rng.standard_normal((num_tokens, hidden), dtype=np.float32)          # [T, H]
    attn = rng.standard_normal((num_tokens, weights.layers[0].wo.shape[0]), dtype=np.float32)  # [T, nh * hd]
    act = rng.standard_normal((num_tokens, ffn), dtype=np.float32)           # [T, F]
    rows = x[:num_head_rows]                                                 # [N, H]

    def once() -> float:
        t0 = time.perf_counter()
        for layer in weights.layers:
            matmul(x, layer.wqkv)                                            # [T, (nh + 2 nkv) * hd]
            matmul(attn, layer.wo)                                           # [T, H]
            if layer.w_gate_up is not None and layer.w_down is not None:    # not the experts' products
                matmul(x, layer.w_gate_up)                                   # [T, 2F]
                matmul(act, layer.w_down)                                    # [T, H]
        matmul(rows, weights.head)                                           # [N, V]
        return time.perf_counter() - t0

    once()                                                                   # warm the BLAS pool
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_time_s:
        times.append(once())
    return statistics.median(times)


def _chunks(num_tokens: int, budget: int) -> list[int]:
    return [min(budget, num_tokens - start) for start in range(0, num_tokens, budget)]


def model_bench(model: str | os.PathLike[str] | None, *, concurrency: Sequence[int] = (1, 8, 32, 64),
                prompt_len: int = 200, max_new: int = 128, prefill_len: int = 1000,
                max_num_batched_tokens: int = 512, blas_threads: int | None = None, block_size: int = 16,
                seed: int = 0, kernels: str = "auto", numerics: str = "reference", kv_cache_dtype: str = "float32",
                progress: Progress = _quiet) -> dict[str, Any]:
    """Throughput of the real model: `concurrency` sequences at once (random prompts of prompt_len
    ids, max_new greedy tokens, ignore_eos), a prefill of prefill_len tokens, load time, peak RSS,
    and the matmul-only rate for the same tokens per step. Prefix caching is off: no run reuses
    another's work."""
    if not concurrency or min(concurrency) < 1 or min(prompt_len, max_new, prefill_len) < 1:
        raise ValueError("concurrency, prompt_len, max_new and prefill_len must be positive")
    configure_matmul("split", blas_threads)
    t0 = time.perf_counter()
    loaded = LoadedModel.load(model, kernels=kernels, numerics=numerics, progress=progress)
    load_s = time.perf_counter() - t0
    rss_after_load = _peak_rss_mib()
    mc = loaded.model.config
    max_model_len = min(mc.max_position, max(prefill_len + 1, prompt_len + max_new, 2 * block_size))
    seq_blocks = -(-(prompt_len + max_new) // block_size)
    num_blocks = max(max(concurrency) * seq_blocks, -(-max_model_len // block_size)) + 8
    per_block = KVCache.bytes_per_block(mc, block_size, kv_cache_dtype)

    def engine(max_num_seqs: int) -> LLMEngine:
        return LLMEngine(loaded, EngineConfig(
            block_size=block_size, kv_cache_memory=num_blocks * per_block, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=False, blas_threads=blas_threads, kernels=kernels, numerics=numerics,
            kv_cache_dtype=kv_cache_dtype))

    rng = random.Random(seed)
    greedy = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    warm_up = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _run_requests(engine(1), _prompts(1, 8, mc.vocab_size, rng), warm_up)
    runs = []
    for num_seqs in concurrency:
        progress(f"bench: {num_seqs} sequences x ({prompt_len} prompt + {max_new} new tokens)")
        run = _run_requests(engine(num_seqs), _prompts(num_seqs, prompt_len, mc.vocab_size, rng), greedy)
        matmul_s = matmul_seconds(loaded.model.weights, num_seqs, num_head_rows=num_seqs)
        run["concurrency"] = num_seqs
        run["matmul_only_tokens_per_s"] = round(num_seqs / matmul_s, 2)
        if run["decode_tokens_per_s"]:
            run["decode_fraction_of_matmul_only"] = round(run["decode_tokens_per_s"] * matmul_s / num_seqs, 3)
        runs.append(run)

    progress(f"bench: prefill of {prefill_len} tokens")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill = _run_requests(engine(1), _prompts(1, prefill_len, mc.vocab_size, rng), one)
    chunks = _chunks(prefill_len, max_num_batched_tokens)
    prefill_matmul_s = sum(matmul_seconds(loaded.model.weights, n, num_head_rows=int(i == len(chunks) - 1))
                           for i, n in enumerate(chunks))
    prefill_tok_s = prefill_len / prefill["wall_s"]
    return {
        "mode": "model",
        "model": loaded.name,
        "kernels": loaded.kernels.name, "numerics": loaded.kernels.numerics,
        "attention": "compiled" if loaded.model.compiled_ops else "numpy",
        "kv_cache_dtype": kv_cache_dtype,
        "blas": _blas_info(),
        "num_cpus": os.cpu_count(),
        "prompt_len": prompt_len, "max_new": max_new, "block_size": block_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "load_s": round(load_s, 2),
        "weights_mib": round(loaded.model.weights.nbytes / 2**20, 1),
        "runs": runs,
        "prefill": {"tokens": prefill_len, "seconds": prefill["wall_s"],
                    "tokens_per_s": round(prefill_tok_s, 1), "chunks": chunks,
                    "matmul_only_tokens_per_s": round(prefill_len / prefill_matmul_s, 1),
                    "fraction_of_matmul_only": round(prefill_tok_s * prefill_matmul_s / prefill_len, 3)},
        "peak_rss_mib": {"after_load": rss_after_load, "end": _peak_rss_mib()},
    }


def _peak_rss_mib() -> float:
    """Peak resident set of this process so far (ru_maxrss is in KiB on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _blas_info() -> list[dict[str, Any]]:
    from threadpoolctl import threadpool_info

    return [{k: pool.get(k) for k in ("internal_api", "version", "num_threads", "architecture")}
            for pool in threadpool_info() if pool.get("user_api") == "blas"]


def format_model(result: dict[str, Any]) -> str:
    blas = ", ".join(f"{b['internal_api']} {b['version']} ({b['num_threads']} threads)" for b in result["blas"])
    lines = [
        f"model bench: {result['model']}  kernels {result['kernels']}, {result['numerics']} numerics "
        f"(attention {result['attention']}, "
        f"KV {result['kv_cache_dtype']})  "
        f"load {result['load_s']} s  "
        f"weights {result['weights_mib']} MiB  "
        f"peak RSS {result['peak_rss_mib']['end']} MiB",
        f"  {blas}; {result['num_cpus']} CPUs; prompt {result['prompt_len']}, {result['max_new']} new tokens, "
        f"budget {result['max_num_batched_tokens']} tokens/step",
        f"  {'seqs':>5} {'out tok/s':>10} {'decode tok/s':>13} {'matmul-only':>12} {'fraction':>9} "
        f"{'TTFT p50':>9} {'wall s':>8} {'cpu/wall':>9}",
    ]
    for r in result["runs"]:
        fraction = r.get("decode_fraction_of_matmul_only")
        lines.append(
            f"  {r['concurrency']:>5} {r['output_tokens_per_s']:>10} {r['decode_tokens_per_s'] or '-':>13} "
            f"{r['matmul_only_tokens_per_s']:>12} {'-' if fraction is None else f'{fraction:.0%}':>9} "
            f"{r['ttft_p50_s']:>9} {r['wall_s']:>8} {r['cpu_s'] / r['wall_s']:>9.2f}")
    p = result["prefill"]
    lines.append(f"  prefill {p['tokens']} tokens: {p['tokens_per_s']} tok/s in {p['seconds']} s "
                 f"(chunks {p['chunks']}; matmul-only {p['matmul_only_tokens_per_s']} tok/s, "
                 f"{p['fraction_of_matmul_only']:.0%} of it)")
    return "\n".join(lines)
