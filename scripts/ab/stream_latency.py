"""One streaming client's first-token time and inter-token gaps against a running forge serve.

    .venv/bin/python scripts/ab/stream_latency.py [--addr 127.0.0.1:8080] [--max-tokens 48]

Sends, one after the other, a short prompt (3 tokens) and a long one (~260 tokens) to
/v1/completions with stream=true, ignore_eos and greedy sampling, and prints each one's time to the
first frame and the median and mean gap between frames. Figures only; not part of forge.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

PROMPTS = ["Hello there", "The history of the number " * 40]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addr", default="127.0.0.1:8080")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0}
        frames: list[float] = []
        start = time.perf_counter()
        with httpx.stream("POST", f"http://{args.addr}/v1/completions", json=body, timeout=600) as response:
            if response.status_code != 200:
                raise SystemExit(f"{response.status_code}: {response.read().decode()}")
            for line in response.iter_lines():
                if line.startswith("data:") and "choices" in line:
                    frames.append(time.perf_counter())
        gaps = [b - a for a, b in zip(frames, frames[1:], strict=False)]
        print(f"prompt of {len(prompt)} characters: first token {frames[0] - start:.2f} s, "
              f"inter-token p50 {statistics.median(gaps) * 1e3:.1f} ms, mean {statistics.mean(gaps) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
