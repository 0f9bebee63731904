"""A/B of forge configurations over HTTP: each arm a fresh `forge serve` (a cold prefix cache, the
first pass over the prompts), the arms alternating round by round, the same closed-loop workload.

    .venv/bin/python scripts/ab/ab_serve.py --rounds 2 \\
        --arm "fixed=" --arm "target 300=--max-step-ms 300"

An arm is LABEL=FLAGS (flags for `forge serve`), or LABEL@PATH=FLAGS to run the forge checkout at
PATH (e.g. a `git worktree` of another commit) with this venv. Reported per arm and round: output
tok/s, TTFT and ITL p50/p99 with their ratios (the tails issue's figures), goodput, and TTFT p50/p99
by prompt kind. --kinds and --ignore-eos as `forge bench serve` takes them. --json saves every record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from forge.models.hub import resolve_model
from forge.text.tokenizer import Tokenizer
from forge_bench import loadgen
from forge_bench.servers import free_port, stop, wait_healthy


def run_arm(label: str, flags: str, workload: loadgen.Workload, args: argparse.Namespace) -> dict[str, Any]:
    label, _, path = label.partition("@")
    port = free_port()
    env = dict(os.environ)
    checkout = Path(path).resolve() if path else None
    if checkout is not None:
        # `python -m` puts the working directory first on sys.path: run from the checkout, or the
        # arm imports the forge it was started next to (this repository), whatever PYTHONPATH says.
        env["PYTHONPATH"] = str(checkout)
    cmd = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}",
           "--max-num-seqs", str(args.concurrency), "--log-level", "warning", *flags.split()]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=checkout)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base + "/healthz", proc)
            num = args.requests_per_stream * args.concurrency
            extra = {"ignore_eos": False} if args.ignore_eos == "false" else None
            results, wall = anyio.run(lambda: loadgen.run_closed_loop(base, workload, args.concurrency, num,
                                                                      progress=False, extra=extra))
            steps = step_histogram(base)
        finally:
            stop(proc)
    rec = loadgen.level_record(label, args.concurrency, results, wall, args.ttft_slo, args.tpot_slo)
    rec["flags"], rec["checkout"], rec["steps"] = flags, path or ".", steps
    return rec


def step_histogram(base: str) -> dict[str, Any]:
    """The engine's step times over the run, from forge:step_duration_seconds: count, mean, and
    the share of steps over each bucket bound (what makes the inter-token tail)."""
    text = httpx.get(f"{base}/metrics").text
    buckets, total, count = {}, 0.0, 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "forge:step_duration_seconds_bucket":
                buckets[s.labels["le"]] = s.value
            elif s.name == "forge:step_duration_seconds_sum":
                total = s.value
            elif s.name == "forge:step_duration_seconds_count":
                count = s.value
    over = {le: round(1 - n / count, 3) for le, n in buckets.items() if count and le in ("0.3", "0.5", "0.75", "1.0")}
    return {"count": int(count), "mean_ms": round(1000 * total / count, 1) if count else None, "share_over_s": over}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True, help="LABEL=FLAGS or LABEL@PATH=FLAGS")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workload-size", type=int, default=96)
    parser.add_argument("--ttft-slo", type=float, default=10.0)
    parser.add_argument("--tpot-slo", type=float, default=0.5)
    parser.add_argument("--kinds", default="open,shared-prefix,grounded",
                        help=f"prompt kinds of the workload: {', '.join(loadgen.WORKLOAD_KINDS)}")
    parser.add_argument("--ignore-eos", default="true", choices=["true", "false"],
                        help="false: every request stops where the model ends it")
    parser.add_argument("--json", default=None, help="save the records here")
    args = parser.parse_args()
    arms = [a.split("=", 1) if "=" in a else (a, "") for a in args.arm]
    workload = loadgen.build_workload(Tokenizer.from_gguf(resolve_model(None, lambda _: None)),
                                      num_requests=args.workload_size, max_tokens=args.max_tokens,
                                      kinds=tuple(k for k in args.kinds.split(",") if k))
    records = []
    for r in range(args.rounds):
        for label, flags in arms:
            rec = run_arm(label, flags, workload, args)
            rec["round"] = r + 1
            records.append(rec)
            print(json.dumps({k: rec[k] for k in ("server", "round", "output_tok_s", "ttft_p50", "ttft_p99",
                                                    "itl_p50", "itl_p99", "errors", "steps")}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    print("\n| arm | round | output tok/s | TTFT p50 s | TTFT p99 s | TTFT p99/p50 | ITL p50 ms | ITL p99 ms "
          "| ITL p99/p50 | within SLO |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rec in records:
        print(f"| {rec['server']} | {rec['round']} | {rec['output_tok_s']} | {rec['ttft_p50']} | {rec['ttft_p99']} "
              f"| {ratio(rec['ttft_p99'], rec['ttft_p50'])} | {1000 * (rec['itl_p50'] or 0):.0f} "
              f"| {1000 * (rec['itl_p99'] or 0):.0f} | {ratio(rec['itl_p99'], rec['itl_p50'])} "
              f"| {rec['goodput_share']:.0%} |")
    print("\nTTFT p50 / p99 (s) by prompt kind:")
    kinds = sorted({k for rec in records for k in rec["by_kind"]})
    print("| arm | round | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for rec in records:
        cells = [f"{rec['by_kind'][k]['ttft_p50']} / {rec['by_kind'][k]['ttft_p99']}" if k in rec["by_kind"]
                 else "" for k in kinds]
        print(f"| {rec['server']} | {rec['round']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
