"""onnxruntime's memory patterns, on or off: resident memory over many batches, and speed.

    .venv/bin/python scripts/ab/ab_memory.py rss --mem-pattern off --rounds 12
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/ab/ab_memory.py rss --mem-pattern on --rounds 12
    .venv/bin/python scripts/ab/ab_memory.py speed --mem-pattern on     # alternate on/off, a few rounds

`rss`: rounds of LLM.generate over random batches (4-24 prompts of 5-400 words, 8-64 greedy tokens
each, a 512 MiB KV cache), printing the process's RSS after each round: a step's row count changes
nearly every step, so a per-shape cache shows up as RSS that keeps climbing. `speed`: the offline
model benchmark (forge.offline_bench.model_bench) at 1, 8 and 32 sequences. forge runs with patterns off;
`--mem-pattern on` puts them back for the comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import onnxruntime as ort

import forge.kernels.onnx_linear as onnx_linear
from forge import offline_bench as bench
from forge.config import EngineConfig
from forge.llm import LLM
from forge.sampling.sampling_params import SamplingParams

WORDS = ["river", "stone", "light", "the", "a", "old", "new", "house"]


def with_patterns(on: bool) -> None:
    """Make every onnxruntime session forge creates from now on use memory patterns or not."""
    make = onnx_linear.session_options

    def options(num_threads: int) -> ort.SessionOptions:
        opts = make(num_threads)
        opts.enable_mem_pattern = on
        return opts

    onnx_linear.session_options = options   # type: ignore[assignment]


def rss_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    return -1


def rss_rounds(rounds: int, seed: int) -> None:
    llm = LLM(None, EngineConfig(kv_cache_memory=512 * 2**20, max_model_len=2048, max_num_seqs=16),
              progress=lambda _: None)
    rng = random.Random(seed)
    start = time.monotonic()
    print(json.dumps({"round": "loaded", "rss_mib": rss_mib()}), flush=True)
    for r in range(rounds):
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 400))) for _ in range(rng.randint(4, 24))]
        params = [SamplingParams(max_tokens=rng.choice([8, 32, 64]), temperature=0.0, ignore_eos=True)
                  for _ in prompts]
        llm.generate(prompts, params)
        print(json.dumps({"round": r + 1, "rss_mib": rss_mib(), "seconds": round(time.monotonic() - start)}),
              flush=True)


def speed() -> None:
    result = bench.model_bench(None, concurrency=[1, 8, 32], prompt_len=200, max_new=64, prefill_len=1000)
    print(json.dumps({"runs": [{k: run[k] for k in ("concurrency", "output_tokens_per_s", "decode_tokens_per_s")}
                               for run in result["runs"]],
                      "prefill_tokens_per_s": result["prefill"]["tokens_per_s"],
                      "peak_rss_mib": result["peak_rss_mib"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["rss", "speed"])
    parser.add_argument("--mem-pattern", choices=["on", "off"], default="off")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with_patterns(args.mem_pattern == "on")
    if args.what == "rss":
        rss_rounds(args.rounds, args.seed)
    else:
        speed()


if __name__ == "__main__":
    main()
