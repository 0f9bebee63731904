"""What the work proportional to one request's size costs, off a daemon: the stop-string automaton and the
prompt encoder (issue 51's cases 1 and 6).

- `stops`: building forge.text.stops.StopAutomaton for sets of stop strings up to the limit (four of 4,096
  characters) and past it (one of 150,000), each built --rounds times: the best time and the peak memory
  tracemalloc sees.
- `encode`: the default model's tokenizer on a prompt of --chars digits in a worker thread, while the main
  thread wakes every millisecond (as the event loop would): the encode time and the main thread's worst
  gap, for `encode` and for `encode_batch` (which lets the GIL go). Prints figures; asserts nothing.

    .venv/bin/python scripts/ab/input_costs.py stops
    .venv/bin/python scripts/ab/input_costs.py encode --chars 1000000
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import tracemalloc
from collections.abc import Callable

from forge.models.hub import default_model_path
from forge.text.stops import StopAutomaton
from forge.text.tokenizer import Tokenizer


def stops(rounds: int) -> None:
    rng = random.Random(1)
    cases = {
        "two short (7 and 3 characters)": ["\n\nUser:", "###"],
        "four of 1,024": ["x" * 1024, "y" * 1024, "ab" * 512, "z" * 1024],
        "four of 4,096 (the limit)": ["x" * 4096, "ab" * 2048, "".join(rng.choice("abc") for _ in range(4096)),
                                      "y" * 4096],
        "one of 150,000 (past the limit)": ["x" * 150_000],
    }
    for name, strings in cases.items():
        best = min(_timed(lambda s=strings: StopAutomaton(s)) for _ in range(rounds))
        tracemalloc.start()
        StopAutomaton(strings)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(json.dumps({"stops": name, "build_ms": round(best * 1e3, 3), "peak_mib": round(peak / 2**20, 2)}))


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def encode(chars: int) -> None:
    tok = Tokenizer.from_gguf(default_model_path())
    text = "1234567890" * (chars // 10)
    calls: dict[str, Callable[[], object]] = {
        "encode (holds the GIL)": lambda: tok._bpe.encode(text, add_special_tokens=False),
        "encode_batch (lets it go)": lambda: tok._bpe.encode_batch([text], add_special_tokens=False),
    }
    for name, call in calls.items():
        seconds: list[float] = []
        worker = threading.Thread(target=lambda c=call, out=seconds: out.append(_timed(c)))
        worst, last = 0.0, time.perf_counter()
        worker.start()
        while worker.is_alive():
            time.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        worker.join()
        print(json.dumps({"call": name, "chars": len(text), "encode_s": round(seconds[0], 3),
                          "main_thread_worst_gap_ms": round(worst * 1e3, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=("stops", "encode"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chars", type=int, default=1_000_000)
    args = parser.parse_args()
    if args.case == "stops":
        stops(args.rounds)
    else:
        encode(args.chars)


if __name__ == "__main__":
    main()
