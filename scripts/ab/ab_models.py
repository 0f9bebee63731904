"""Several models in one daemon, measured as a user meets them: one `forge serve --model A --model B ...`
(nothing preloaded), then

1. **cold vs loaded TTFT** per model: a streamed request for a model not loaded (its TTFT holds the load:
   mapping the file, the K/V, the compiled kernels) against the next request, with another prompt of the same
   length, once it is loaded; the model is unloaded (POST /models/unload) between rounds;
2. **two models at once vs each alone**: `--concurrency` closed-loop clients on one model, on the other, then
   both sets at once (each model its own batch, the cores shared), in output tok/s.

    .venv/bin/python scripts/ab/ab_models.py --model smollm2=default --model gemma=gemma-3-270m \\
        --model bench-1.7b=~/.cache/forge/bench-models/bench-1.7b-Q4_K_M.gguf --rounds 3 \\
        --pair smollm2,gemma --concurrency 4 --requests 16

A model is ID=SOURCE (a catalog name or a GGUF path; `default`: the default model), at least two of them (one
model is served alone, with nothing to load or unload). Every figure is the
median over --rounds. --json saves every record. An older commit: run this script from a worktree of it
(`cd .bench/old && ../../.venv/bin/python ../../scripts/ab/ab_models.py ...`): the daemon is started with
`python -m actors` in the working directory, so it is that checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import httpx

from forge.models.hub import resolve_model
from forge.text.tokenizer import Tokenizer
from forge_bench import loadgen
from forge_bench.servers import free_port, stop, wait_healthy

WORDS = ("river stone lantern orchard copper meadow signal harbor violet engine quiet summit ledger "
         "thistle canyon marble ember willow fabric comet").split()


def prompt(seed: int, num_words: int) -> str:
    """Distinct text of one length (no prefix shared between seeds: the prefix cache cannot help)."""
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(num_words)) + "\nContinue:"


async def ttft(base: str, model: str, text: str, max_tokens: int) -> float:
    """The TTFT of one streamed request, as `forge bench` measures it (forge_bench.loadgen)."""
    workload = loadgen.Workload([loadgen.WorkItem(text, "single", 0)], max_tokens)
    (result,), _ = await loadgen.run_closed_loop(base, workload, 1, 1, model=model, progress=False)
    if not result.ok or result.ttft_s is None:
        raise RuntimeError(f"{model}: {result.error or 'no token streamed'}")
    return result.ttft_s


async def cold_and_loaded(base: str, models: list[str], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        for model in models:
            cold, loaded = [], []
            for r in range(args.rounds):
                cold.append(await ttft(base, model, prompt(2 * r, args.prompt_words), args.max_tokens))
                loaded.append(await ttft(base, model, prompt(2 * r + 1, args.prompt_words), args.max_tokens))
                done = await client.post("/models/unload", json={"model": model})
                if done.status_code != 200:
                    raise RuntimeError(f"unload {model}: {done.status_code} {done.text[:300]}")
            out[model] = {"cold_ttft_s": cold, "loaded_ttft_s": loaded,
                          "cold_p50": statistics.median(cold), "loaded_p50": statistics.median(loaded)}
            print(f"{model}: cold TTFT {out[model]['cold_p50']:.3f} s, loaded {out[model]['loaded_p50']:.3f} s "
                  f"({out[model]['cold_p50'] / out[model]['loaded_p50']:.1f}x)", flush=True)
    return out


async def throughput(base: str, pair: list[str], workload: loadgen.Workload,
                     args: argparse.Namespace) -> dict[str, Any]:
    async def run(model: str) -> tuple[str, dict[str, Any]]:
        results, wall = await loadgen.run_closed_loop(base, workload, args.concurrency, args.requests,
                                                      model=model, progress=False)
        return model, loadgen.summarize(results, wall, ttft_slo=10.0, tpot_slo=1.0)

    for model in pair:                                      # both loaded before anything is timed
        await ttft(base, model, prompt(99, 8), 2)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        rec: dict[str, Any] = {}
        for model in pair:
            rec[f"{model} alone"] = (await run(model))[1]
        async def both(model: str, into: dict[str, Any]) -> None:
            into[f"{model} together"] = (await run(model))[1]

        async with anyio.create_task_group() as tg:
            for model in pair:
                tg.start_soon(both, model, rec)
        rounds.append(rec)
        errors = sum(s["errors"] for s in rec.values())
        line = ", ".join(f"{k} {s['output_tok_s']:.1f}" for k, s in rec.items())
        print(f"round {r + 1}: output tok/s: {line}" + (f" ({errors} errors)" if errors else ""), flush=True)
    med = {k: statistics.median(rd[k]["output_tok_s"] for rd in rounds) for k in rounds[0]}
    alone = {m: med[f"{m} alone"] for m in pair}
    together = {m: med[f"{m} together"] for m in pair}
    summary = {"alone": alone, "together": together, "together_total": sum(together.values()),
               "rounds": rounds}
    print(f"median output tok/s: alone {alone}; together {together}, in all {summary['together_total']:.1f} "
          f"(each alone's mean {statistics.mean(alone.values()):.1f})", flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="ID=SOURCE; repeat")
    ap.add_argument("--pair", default="", help="ID,ID: the two models served at once (none: skip)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="requests per model per throughput run")
    ap.add_argument("--output-tokens", type=int, default=64, help="max_tokens of the throughput requests")
    ap.add_argument("--blas-threads", default="2")
    ap.add_argument("--flags", default="", help="more `forge serve` flags")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if len(args.model) < 2:
        ap.error("give --model at least twice: one model is served alone, without loads and unloads")

    ids, cli = [], []
    for spec in args.model:
        model_id, _, source = spec.partition("=")
        source = os.path.expanduser(source)
        path = resolve_model(None if source == "default" else source, lambda _: None)
        ids.append(model_id)
        cli += ["--model", f"{model_id}={path}"]
    port = free_port()
    cmd = [sys.executable, "-m", "actors", "serve", "--addr", f"127.0.0.1:{port}", "--log-level", "warning",
           "--blas-threads", args.blas_threads, "--max-num-seqs", str(max(8, 2 * args.concurrency)), *cli,
           *args.flags.split()]
    print("$", " ".join(cmd), flush=True)
    report: dict[str, Any] = {"cmd": cmd}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base + "/healthz", proc)
            report["ttft"] = anyio.run(cold_and_loaded, base, ids, args)
            pair = [p for p in args.pair.split(",") if p]
            if pair:
                tokenizer = Tokenizer.from_gguf(resolve_model(None, lambda _: None))
                workload = loadgen.build_workload(tokenizer, num_requests=args.requests,
                                                  max_tokens=args.output_tokens, min_len=20, max_len=400,
                                                  kinds=("open", "grounded"))
                report["throughput"] = anyio.run(throughput, base, pair, workload, args)
        finally:
            stop(proc)
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
        if proc.returncode not in (0, -15) and tail:
            print(tail, file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
