"""Time forge's sampler on one step's logits, for several kinds of sampling parameters.

Every row of a batch gets the same parameters; the logits are random with a few strong candidates
per row (as a real model's are), and each row's penalty counts hold 200 distinct tokens. Prints the
best of --repeats runs per case, per step and per row. Not part of forge and not run by tests: a
measuring tool (it was tests/unit/test_sampling.py's test_speed_report, which asserted nothing).

    .venv/bin/python scripts/ab/bench_sampler.py
    .venv/bin/python scripts/ab/bench_sampler.py --rows 64 --repeats 10
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from forge.sampling.penalties import TokenHistory  # noqa: E402
from forge.sampling.sampler import Sampler, SamplingBatch  # noqa: E402
from forge.sampling.sampling_params import SamplingParams, make_generator  # noqa: E402

EOS = 2
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 1, top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "temperature 1, top_p 0.95, penalties": SamplingParams(top_p=0.95, presence_penalty=0.5, repetition_penalty=1.1),
    "temperature 1, logprobs 5": SamplingParams(temperature=1.0, logprobs=5),
}


def make_logits(num_rows: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((num_rows, vocab_size)) * 2.0).astype(np.float32)
    for r in range(num_rows):                                          # a few strong candidates per row
        logits[r, rng.choice(vocab_size, 20, replace=False)] += rng.uniform(4.0, 14.0, 20).astype(np.float32)
    return logits


def make_batch(params: SamplingParams, num_rows: int) -> SamplingBatch:
    return SamplingBatch(params=[params] * num_rows,
                         generators=[make_generator(params.seed) for _ in range(num_rows)],
                         counts=[TokenHistory(range(200)) for _ in range(num_rows)],
                         num_output_tokens=[0] * num_rows)


def best_time(sampler: Sampler, logits: np.ndarray, params: SamplingParams, repeats: int) -> float:
    """Seconds of the fastest of `repeats` sample() calls: the least disturbed by other jobs."""
    batch = make_batch(params, logits.shape[0])
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(logits, batch)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="sequences in the batch (default 32)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default 49152, SmolLM2's)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per case; the best is shown (default 5)")
    args = parser.parse_args()
    logits = make_logits(args.rows, args.vocab)
    sampler = Sampler(eos_token_id=EOS)
    print(f"sampler, {args.rows} x {args.vocab}, best of {args.repeats}:")
    for name, params in CASES.items():
        best = best_time(sampler, logits, params, args.repeats)
        print(f"{name:40s} {best * 1e3:7.2f} ms per step ({best * 1e6 / args.rows:6.1f} us per row)")


if __name__ == "__main__":
    main()
