"""Fidelity of each KV cache dtype (and kernel backend) against the committed reference data.

Runs every greedy and logprob case of tests/data/smollm2_reference.json (made by transformers in
float32, scripts/make_reference.py) through the offline engine, and prints per configuration: the
greedy cases whose tokens match the reference up to their first near-tie (top-2 gap < 1e-3, where
any float32 engine may flip), and the largest error of the top-5 logprobs. Figures only.

    .venv/bin/python scripts/kv_fidelity.py [--kernels onnxruntime,numpy] [--dtypes float32,float16,bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from forge.config import EngineConfig
from forge.llm import LLMEngine, LoadedModel
from forge.sampling_params import SamplingParams

DATA = json.loads((Path(__file__).resolve().parents[1] / "tests/data/smollm2_reference.json").read_text())
TIE_GAP = 1e-3


def run(loaded: LoadedModel, kv_dtype: str) -> dict[str, Any]:
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, case in enumerate(DATA["greedy"]):
        requests[f"greedy-{i}"] = (case["prompt_ids"], SamplingParams(
            max_tokens=DATA["num_greedy_tokens"], temperature=0.0, ignore_eos=True))
    for i, case in enumerate(DATA["logprobs"]):
        requests[f"logprobs-{i}"] = (case["prompt_ids"], SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=len(case["top5"])))
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=512 * 2**20, max_model_len=512, kernels=loaded.kernels.name,
                                            max_num_seqs=len(requests), max_num_batched_tokens=2048,
                                            kv_cache_dtype=kv_dtype))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    logprobs: dict[str, list[Any]] = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_work():
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.token_ids)
            logprobs[ev.request_id].extend(ev.logprobs)
    matched = 0
    for i, case in enumerate(DATA["greedy"]):
        cut = next((j for j, gap in enumerate(case["top2_gap"]) if gap < TIE_GAP), len(case["output_ids"]))
        matched += tokens[f"greedy-{i}"][:cut] == case["output_ids"][:cut]
    worst = 0.0
    for i, case in enumerate(DATA["logprobs"]):
        got = dict(logprobs[f"logprobs-{i}"][0].top_logprobs)
        for token_id, lp in case["top5"]:
            if int(token_id) in got:
                worst = max(worst, abs(got[int(token_id)] - float(lp)))
    return {"greedy_matched": matched, "greedy_cases": len(DATA["greedy"]), "max_logprob_error": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="onnxruntime,numpy")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    args = parser.parse_args()
    print("kernels      kv dtype   greedy (to first near-tie)   max top-5 logprob error")
    for kernels in args.kernels.split(","):
        loaded = LoadedModel.load(None, kernels=kernels, progress=lambda _m: None)
        for dtype in args.dtypes.split(","):
            r = run(loaded, dtype)
            print(f"{kernels:12s} {dtype:10s} {r['greedy_matched']:>3d} / {r['greedy_cases']:<3d}"
                  f"                    {r['max_logprob_error']:.2e}")


if __name__ == "__main__":
    main()
