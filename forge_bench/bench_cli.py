"""`forge bench serve` and `forge bench compare`: serving benchmarks over HTTP.

serve: drive any OpenAI-compatible server at closed-loop concurrency levels (and optionally an
open-loop Poisson rate) and print or save the figures.
compare: start forge and llama.cpp's llama-server on the same GGUF with equivalent settings, one at
a time (A B A B, never both at once: each needs the whole machine), run the same workload against
each, and write a table of forge / llama-server ratios. --peer-command starts another server
instead of llama-server (vLLM's, say: docs/benchmarks.md), in a process group of its own that is
stopped whole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from forge.models.hub import resolve_model
from forge.text.tokenizer import Tokenizer
from forge_bench import loadgen, servers


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _tokenizer(model: str | None) -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model(model, lambda m: print(f"forge: {m}", file=sys.stderr)))


def _requests_for(concurrency: int, args: argparse.Namespace) -> int:
    return max(int(args.min_requests), int(args.requests_per_stream) * concurrency)


async def _run_levels(base: str, server: str, workload: loadgen.Workload, args: argparse.Namespace,
                      model: str | None) -> list[dict[str, Any]]:
    records = []
    extra = {"ignore_eos": False} if getattr(args, "ignore_eos", "true") == "false" else None
    served = 0      # each level goes on through the workload: a prompt a level before served is not in
    for c in _levels(args.concurrency):   # the servers' prompt caches to flatter the next one
        num = _requests_for(c, args)
        results, wall = await loadgen.run_closed_loop(base, workload, c, num, model=model,
                                                      progress=not args.quiet, extra=extra,
                                                      api_key=getattr(args, "api_key", None), first=served)
        served += num
        records.append(loadgen.level_record(server, c, results, wall, args.ttft_slo, args.tpot_slo))
    if args.rate:
        n = args.rate_requests
        results, wall = await loadgen.run_open_loop(base, workload, args.rate, n, seed=args.seed, model=model,
                                                    progress=not args.quiet, extra=extra,
                                                    api_key=getattr(args, "api_key", None))
        rec = loadgen.level_record(server, 0, results, wall, args.ttft_slo, args.tpot_slo)
        rec["rate"] = args.rate
        records.append(rec)
    return records


def _table(records: list[dict[str, Any]]) -> str:
    head = ("| server | streams | output tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | ITL p99 "
            "| e2e p50 | within SLO | errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r['server']} | {r['concurrency'] or 'rate ' + str(r.get('rate'))} | {r['output_tok_s']} "
            f"| {r['req_s']} | {r['ttft_p50']} | {r['ttft_p99']} | {r['tpot_p50']} | {r['itl_p50']} | {r['itl_p99']} "
            f"| {r['e2e_p50']} | {_share(r.get('goodput_share'))} | {r['errors']} |" for r in records]
    return "\n".join([head, *rows])


def _share(value: float | None) -> str:
    """Goodput as a share of the requests (TTFT and TPOT within --ttft-slo / --tpot-slo)."""
    return "n/a" if value is None else f"{value:.0%}"


def cmd_serve(args: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in loadgen.WORKLOAD_KINDS]
    if unknown or not kinds:
        raise SystemExit(f"forge bench: --kinds takes {', '.join(loadgen.WORKLOAD_KINDS)}; got {args.kinds!r}")
    workload = loadgen.build_workload(_tokenizer(args.tokenizer_model), num_requests=args.workload_size,
                                      max_tokens=args.max_tokens, seed=args.seed, kinds=kinds)
    records = anyio.run(_run_levels, args.base.rstrip("/"), args.label, workload, args, args.model)
    print(json.dumps(records, indent=1) if args.json else _table(records))
    if args.output:
        Path(args.output).write_text(json.dumps(records, indent=1))
    if args.plot:
        loadgen.plot(records, args.plot)
    return 0


# ---- compare -------------------------------------------------------------------------------------

def _peer(args: argparse.Namespace) -> str:
    """The name of the server forge is compared with."""
    return str(args.peer_name) if getattr(args, "peer_command", None) else "llama-server"


def cmd_compare(args: argparse.Namespace) -> int:
    from forge.models.hub import resolve_model

    model_path = str(resolve_model(args.model, lambda m: print(f"forge: {m}", file=sys.stderr)))
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    workload = loadgen.build_workload(_tokenizer(model_path), num_requests=args.workload_size,
                                      max_tokens=args.max_tokens, seed=args.seed)
    max_streams = max(_levels(args.concurrency))
    args.server_info, args.ready_s = {}, {}
    print(f"model file read once into the page cache: {warm_page_cache(Path(model_path)):.1f} s", file=sys.stderr)
    records: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for server in ("forge", _peer(args)):
            print(f"round {rnd + 1}: {server}", file=sys.stderr)
            proc, base = servers.start(server, args, model_path, max_streams)
            model = args.peer_model if server != "forge" else None
            try:
                for rec in anyio.run(_run_levels, base, server, workload, args, model):
                    rec["round"] = rnd + 1
                    records.append(rec)
                group = server != "forge" and bool(args.peer_command)
                rss = servers.group_peak_rss_mib(proc.pid) if group else servers.peak_rss_mib(proc.pid)
                for rec in records:
                    if rec["server"] == server and rec["round"] == rnd + 1:
                        rec["peak_rss_mib"], rec["ready_s"] = rss, args.ready_s[server]
            finally:
                servers.stop(proc, server != "forge" and bool(args.peer_command))
    report = compare_report(records, args)
    print(report)
    Path(args.output).write_text(json.dumps(records, indent=1))
    if args.plot:
        loadgen.plot(records, args.plot)
    if args.write:
        _write_section(Path(args.write), report)
    return 0


def warm_page_cache(path: Path, chunk: int = 16 << 20) -> float:
    """Read the model file once, so that neither server's start-up pays the disk's read and the other's
    not (the first one launched would, where the file is not cached yet). Returns the seconds it took."""
    started = time.monotonic()
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.monotonic() - started


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def compare_report(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    peer = _peer(args)
    lines = [f"| streams | metric | forge | {peer} | forge / {peer} |", "|---|---|---|---|---|"]
    metrics = [("output_tok_s", "output tok/s"), ("ttft_p50", "TTFT p50 s"), ("tpot_p50", "TPOT p50 s"),
               ("e2e_p50", "e2e p50 s"), ("errors", "errors"), ("peak_rss_mib", "peak RSS MiB"),
               ("ready_s", "start-up to ready s")]
    for c in _levels(args.concurrency):
        for key, label in metrics:
            f = _median([r.get(key) for r in records if r["server"] == "forge" and r["concurrency"] == c])
            p = _median([r.get(key) for r in records if r["server"] == peer and r["concurrency"] == c])
            ratio = f"{f / p:.2f}" if f is not None and p else "n/a"
            lines.append(f"| {c} | {label} | {f} | {p} | {ratio} |")
        grounded = [(r["server"], r["by_kind"].get("grounded", {}).get("output_tok_s")) for r in records
                    if r["concurrency"] == c]
        f = _median([v for s, v in grounded if s == "forge"])
        p = _median([v for s, v in grounded if s == peer])
        if f is not None and p:
            lines.append(f"| {c} | output tok/s of the input-grounded third | {f} | {p} | {f / p:.2f} |")
    machine = f"{platform.node() and 'host'}: {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    return "\n".join([
        f"Command: `forge bench compare --concurrency {args.concurrency} --rounds {args.rounds} "
        f"--max-tokens {args.max_tokens}`  ",
        f"Machine: {machine}; medians over {args.rounds} rounds, servers run one at a time "
        f"({' '.join(['A B'] * args.rounds)}), the model file read into the page cache before the first.  ",
        *[f"{info}  " for info in getattr(args, "server_info", {}).values()],
        "", *lines])


def _write_section(path: Path, report: str) -> None:
    begin, end = "<!-- compare:begin -->", "<!-- compare:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{begin}\n{report}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n## forge vs llama-server\n\n" + block + "\n"
    path.write_text(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forge bench", description="serving benchmarks over HTTP")
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--concurrency", default="1,4,16,32,64", help="closed-loop stream counts")
    common.add_argument("--requests-per-stream", type=int, default=2)
    common.add_argument("--min-requests", type=int, default=8)
    common.add_argument("--workload-size", type=int, default=96, help="distinct prompts in the workload")
    common.add_argument("--max-tokens", type=int, default=128)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--rate", type=float, default=None, help="also run an open-loop Poisson rate (req/s)")
    common.add_argument("--rate-requests", type=int, default=32)
    common.add_argument("--ttft-slo", type=float, default=10.0, help="goodput: TTFT target in seconds")
    common.add_argument("--tpot-slo", type=float, default=0.5, help="goodput: TPOT target in seconds")
    common.add_argument("--plot", default=None, help="write a PNG of throughput and latency")
    common.add_argument("--quiet", action="store_true", help="no progress bar")

    serve = sub.add_parser("serve", parents=[common], help="benchmark a running server")
    serve.add_argument("--base", required=True, help="server URL, e.g. http://127.0.0.1:8080")
    serve.add_argument("--model", default=None, help="model name to send")
    serve.add_argument("--label", default="server")
    serve.add_argument("--api-key", default=os.environ.get("FORGE_API_KEY") or None,
                       help="sent as 'Authorization: Bearer KEY' [FORGE_API_KEY]")
    serve.add_argument("--tokenizer-model", default=None, help="GGUF whose tokenizer sizes the prompts")
    serve.add_argument("--kinds", default="open,shared-prefix,grounded",
                       help=f"prompt kinds of the workload, in turn: {', '.join(loadgen.WORKLOAD_KINDS)} "
                            "[open,shared-prefix,grounded]")
    serve.add_argument("--ignore-eos", default="true", choices=["true", "false"],
                       help="every request generates --max-tokens (true), or stops where the model ends (false)")
    serve.add_argument("--json", action="store_true")
    serve.add_argument("--output", default=None, help="also save the records as JSON")
    serve.set_defaults(func=cmd_serve)

    cmp = sub.add_parser("compare", parents=[common], help="forge vs llama-server, same GGUF, same workload")
    cmp.add_argument("--model", default=None, help="GGUF file (default: the default model)")
    cmp.add_argument("--llama-server", default=None, help="path of the llama-server binary")
    cmp.add_argument("--rounds", type=int, default=2)
    cmp.add_argument("--context-per-stream", type=int, default=1536)
    cmp.add_argument("--forge-args", default="", help="extra flags for forge serve")
    cmp.add_argument("--llama-args", default="", help="extra flags for llama-server")
    cmp.add_argument("--peer-command", default=None,
                     help="start this shell command as the peer instead of llama-server ({port}, {model}: the "
                          "GGUF path, {streams}: the most streams); stopped with its whole process group")
    cmp.add_argument("--peer-name", default="peer", help="--peer-command: its name in the table")
    cmp.add_argument("--peer-health", default="/v1/models", help="--peer-command: the path that answers 200 when ready")
    cmp.add_argument("--peer-model", default=None, help="--peer-command: the model name to send it")
    cmp.add_argument("--logs", default=".bench", help="server logs go here")
    cmp.add_argument("--output", default=".bench/compare.json")
    cmp.add_argument("--write", default=None, help="replace the comparison section of this markdown file")
    cmp.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
