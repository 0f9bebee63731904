"""Fidelity of each numerics, KV cache dtype and kernel backend against the committed reference data.

Runs every greedy and logprob case of a reference file (made by transformers in float32,
scripts/reference/make_reference.py / make_family_reference.py) through the offline engine, and prints per
configuration: the greedy cases whose tokens match the reference up to their first near-tie (top-2
gap < 1e-3, where any float32 engine may flip), the largest error of the top-5 logprobs, and the
perplexity of a fixed English text (TEXT, teacher-forced: every position's logits in one forward).
`--against float32` compares with this engine's own outputs over a float32 cache instead (as
scripts/ab/peer_kv_fidelity.py compares llama-server's q8_0 cache with its f16 one); a model given by
its path (a benchmark model of scripts/peer/make_bench_models.py, SmolLM2's tokenizer) has no reference
data and is always compared so, on the default model's prompts. Figures only.

    .venv/bin/python scripts/ab/kv_fidelity.py [--model default|gemma-3-270m|PATH] [--kernels blocks,numpy]
        [--numerics reference,fast] [--dtypes float32,float16,bfloat16,int8] [--against reference|float32]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from forge.config import EngineConfig
from forge.llm import LoadedModel
from forge.models.forward_batch import ForwardBatch
from forge.models.llama.llama_model import CONTEXT_BLOCK_SIZE

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.reference_cases import greedy_agrees, run_reference  # noqa: E402

REFERENCES = {"default": "smollm2_reference.json", "gemma-3-270m": "gemma3_270m_reference.json"}

# The opening of Dickens's A Tale of Two Cities (public domain): the perplexity text.
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way - in short, the period was so far like the present period, that some of its "
    "noisiest authorities insisted on its being received, for good or for evil, in the superlative degree "
    "of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In "
    "both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, "
    "that things in general were settled for ever.")


def perplexity(loaded: LoadedModel, kv_dtype: str) -> float:
    """exp of the mean negative log-likelihood of TEXT's tokens after the first."""
    model = loaded.model
    ids = np.asarray(loaded.tokenizer.encode(TEXT), dtype=np.int64)
    n = len(ids)
    num_blocks = -(-n // CONTEXT_BLOCK_SIZE)
    kv = model.new_kv_cache(num_blocks, CONTEXT_BLOCK_SIZE, kv_dtype)
    batch = ForwardBatch(
        token_ids=ids, positions=np.arange(n, dtype=np.int64), slot_mapping=np.arange(n, dtype=np.int64),
        query_start=np.array([0, n], dtype=np.int64), context_lens=np.array([n], dtype=np.int64),
        block_tables=np.arange(num_blocks, dtype=np.int64)[None, :], sample_indices=np.arange(n, dtype=np.int64))
    logits = model.forward(batch, kv).astype(np.float64)[:-1]                  # [n - 1, V]
    top = logits.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    nll = log_z - logits[np.arange(n - 1), ids[1:]]
    return math.exp(float(nll.mean()))


def own_outputs(loaded: LoadedModel, data: dict[str, Any]) -> dict[str, Any]:
    """`data` with this engine's float32-cache outputs as the expected ones: its greedy tokens (no
    near-ties known: compared whole) and its top-5 logprobs."""
    outputs, _ = run_reference(loaded, data, engine_config(loaded, data, "float32"))
    greedy = [{**case, "output_ids": outputs[f"greedy-{i}"][0], "top2_gap": [1.0] * data["num_greedy_tokens"]}
              for i, case in enumerate(data["greedy"])]
    logprobs = [{**case, "top5": [[t, lp] for t, lp in outputs[f"logprobs-{i}"][1][0].top_logprobs]}
                for i, case in enumerate(data["logprobs"])]
    return {**data, "greedy": greedy, "logprobs": logprobs}


def engine_config(loaded: LoadedModel, data: dict[str, Any], kv_dtype: str) -> EngineConfig:
    return EngineConfig(kv_cache_memory=1536 * 2**20, max_model_len=2048, kernels=loaded.kernels.name,
                        numerics=loaded.kernels.numerics,
                        max_num_seqs=len(data["greedy"]) + len(data["logprobs"]), max_num_batched_tokens=2048,
                        kv_cache_dtype=kv_dtype)


def run(loaded: LoadedModel, data: dict[str, Any], kv_dtype: str) -> dict[str, Any]:
    outputs, _ = run_reference(loaded, data, engine_config(loaded, data, kv_dtype))
    matched = sum(greedy_agrees(case, outputs[f"greedy-{i}"][0]) for i, case in enumerate(data["greedy"]))
    worst = 0.0
    for i, case in enumerate(data["logprobs"]):
        got = dict(outputs[f"logprobs-{i}"][1][0].top_logprobs)
        for token_id, lp in case["top5"]:
            if int(token_id) in got:
                worst = max(worst, abs(got[int(token_id)] - float(lp)))
    return {"greedy_matched": matched, "greedy_cases": len(data["greedy"]), "max_logprob_error": worst,
            "perplexity": perplexity(loaded, kv_dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help=f"{', '.join(sorted(REFERENCES))} or a GGUF file")
    parser.add_argument("--kernels", default="blocks,numpy")
    parser.add_argument("--numerics", default="reference", help="reference,fast (kernels without fast are skipped)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16,int8")
    parser.add_argument("--against", default="reference", choices=["reference", "float32"])
    args = parser.parse_args()
    named = args.model in REFERENCES
    data = json.loads((ROOT / "tests/data" / REFERENCES[args.model if named else "default"]).read_text())
    against = args.against if named else "float32"
    print(f"model {args.model}; against {'transformers' if against == 'reference' else 'its own float32 cache'}; "
          f"perplexity of a {len(TEXT)}-character text")
    print("kernels      numerics   kv dtype   greedy (to first near-tie)   max top-5 logprob error   perplexity")
    for kernels in args.kernels.split(","):
        for numerics in args.numerics.split(","):
            try:
                loaded = LoadedModel.load(None if args.model == "default" else args.model, kernels=kernels,
                                          numerics=numerics, progress=lambda _m: None)
                expected = own_outputs(loaded, data) if against == "float32" else data
            except Exception as exc:                      # a backend without these numerics here
                print(f"{kernels:12s} {numerics:10s} skipped: {exc}")
                continue
            for dtype in args.dtypes.split(","):
                r = run(loaded, expected, dtype)
                print(f"{kernels:12s} {numerics:10s} {dtype:10s} {r['greedy_matched']:>3d} / {r['greedy_cases']:<3d}"
                      f"                    {r['max_logprob_error']:.2e}                  {r['perplexity']:.3f}")


if __name__ == "__main__":
    main()
