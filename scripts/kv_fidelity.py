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
import sys
from pathlib import Path
from typing import Any

from forge.config import EngineConfig
from forge.llm import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.reference_cases import greedy_agrees, run_reference  # noqa: E402

DATA = json.loads((Path(__file__).resolve().parents[1] / "tests/data/smollm2_reference.json").read_text())


def run(loaded: LoadedModel, kv_dtype: str) -> dict[str, Any]:
    outputs, _ = run_reference(loaded, DATA, EngineConfig(
        kv_cache_memory=512 * 2**20, max_model_len=512, kernels=loaded.kernels.name,
        max_num_seqs=len(DATA["greedy"]) + len(DATA["logprobs"]), max_num_batched_tokens=2048,
        kv_cache_dtype=kv_dtype))
    matched = sum(greedy_agrees(case, outputs[f"greedy-{i}"][0]) for i, case in enumerate(DATA["greedy"]))
    worst = 0.0
    for i, case in enumerate(DATA["logprobs"]):
        got = dict(outputs[f"logprobs-{i}"][1][0].top_logprobs)
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
