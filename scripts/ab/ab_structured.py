"""What a grammar costs a decode step: the offline engine at 1 and 32 streams, constrained vs not, A B A B.

Every sequence decodes exactly --max-new tokens (ignore_eos; a finished grammar allows only the end token,
so a constrained sequence keeps paying for its mask to the last step). Prints the mean and p90 of the
pure-decode step time and output tokens/s per arm, and the mask fill alone for the same batch size.
`--plain-only` runs the unconstrained arm alone (to compare forge builds: run it with PYTHONPATH set to
another checkout). Figures, not assertions; the results in docs/benchmarks.md came from this script.

    .venv/bin/python scripts/ab/ab_structured.py [--streams 1,32] [--rounds 2] [--max-new 64] [--schema numbers --raw]
        [--close]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from forge.config import EngineConfig
from forge.llm import LLMEngine, LoadedModel
from forge.messages import StepBatch
from forge.sampling.sampling_params import SamplingParams

SCHEMAS = {
    "notes": {"type": "object", "required": ["notes"],
              "properties": {"notes": {"type": "array", "items": {"type": "string"}}}},
    # what pydantic writes for an invoice: unbounded numbers, objects that do not say additionalProperties
    "numbers": {"type": "object", "required": ["customer", "items", "total"], "properties": {
        "customer": {"type": "string"}, "total": {"type": "number"},
        "items": {"type": "array", "items": {"type": "object", "required": ["product", "quantity", "unit_price"],
                                             "properties": {"product": {"type": "string"},
                                                            "quantity": {"type": "integer"},
                                                            "unit_price": {"type": "number"}}}}}},
}


def run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> tuple[list[float], float, int]:
    steps: list[float] = []

    def on_step(batch: StepBatch, seconds: float) -> None:
        if batch.chunks and all(len(c.token_ids) == 1 for c in batch.chunks):
            steps.append(seconds)

    engine.on_step = on_step
    t0 = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, p)
    tokens = 0
    while engine.has_work():
        tokens += sum(len(ev.token_ids) for ev in engine.step())
    return steps, time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--plain-only", action="store_true")
    ap.add_argument("--schema", choices=sorted(SCHEMAS), default="notes")
    ap.add_argument("--raw", action="store_true",
                    help="also an arm with llguidance's grammar of the schema as given (numbers unbounded, objects "
                         "open): what forge's own bounds and closing cost a step")
    ap.add_argument("--close", action="store_true",
                    help="add an arm 'close': the json arm closing within max_tokens as the daemon's JSON requests do")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loaded = LoadedModel.load(progress=lambda _message: None)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=64))
    grammar = raw = None
    if not args.plain_only:
        import llguidance

        from forge.sampling.structured import JSON_OPTIONS, json_schema_grammar
        grammar = json_schema_grammar(SCHEMAS[args.schema], param="schema")
        raw = str(llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({**SCHEMAS[args.schema], "x-guidance": JSON_OPTIONS})))
    arms = ["plain"] if args.plain_only else ["plain", "json", *(["raw"] if args.raw else []),
                                              *(["close"] if args.close else [])]
    from forge.sampling.structured import CLOSE_WITHIN
    close_within = min(CLOSE_WITHIN, args.max_new // 4)
    results = []
    for streams in (int(s) for s in args.streams.split(",")):
        prompts = [loaded.chat_template.render([{"role": "user", "content": f"Write note {i} about the sea, as JSON."}])
                   for i in range(streams)]
        run(engine, prompts[:1], [SamplingParams(max_tokens=4)])                   # warm
        for rnd in range(args.rounds):
            for arm in arms:
                extra: dict[str, object] = ({"grammar": grammar} if arm == "json" else {"grammar": raw} if arm == "raw"
                                            else {"grammar": grammar, "close_within": close_within} if arm == "close"
                                            else {})
                params = [SamplingParams(max_tokens=args.max_new, temperature=0.8, seed=i, ignore_eos=True, **extra)
                          for i in range(streams)]
                steps, wall, tokens = run(engine, prompts, params)
                row = {"streams": streams, "round": rnd, "arm": arm, "decode_step_ms": 1e3 * statistics.mean(steps),
                       "decode_step_p90_ms": 1e3 * sorted(steps)[int(0.9 * (len(steps) - 1))],
                       "tok_s": tokens / wall}
                results.append(row)
                if not args.json:
                    print(f"{streams:3d} streams  round {rnd}  {arm:5s}  decode step {row['decode_step_ms']:7.2f} ms"
                          f"  (p90 {row['decode_step_p90_ms']:7.2f})  {row['tok_s']:7.1f} tok/s", flush=True)
        if grammar is not None:
            grammars = engine.grammars
            matchers = [grammars.matcher(grammar) for _ in range(streams)]
            t0 = time.perf_counter()
            for _ in range(200):
                grammars.fill_masks(matchers)
            fill = (time.perf_counter() - t0) / 200
            results.append({"streams": streams, "mask_fill_ms": 1e3 * fill})
            if not args.json:
                print(f"{streams:3d} streams  mask fill alone (at the grammar's start): {1e3 * fill:.3f} ms")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
