"""Speculative decoding offline (no HTTP), A B A B: the figures docs/benchmarks.md quotes beside the
serving runs.

    chat     chat prompts that ask for new text (a story, a poem, a plan, a game's rules), one at a
             time, greedy, 128 tokens: output tok/s with --speculative off and ngram, and the share
             of guesses kept
    json     an invoice extracted to JSON under a schema (greedy and seeded, 2 sequences): the same
    rows     what a step with guesses pays for: one layer's four quantized products at 1, 2, 5 and
             8 rows (onnxruntime's one-row path against its several-row one)

    .venv/bin/python scripts/ab_speculative.py [chat json rows] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from forge.config import EngineConfig
from forge.llm import LLM, LoadedModel
from forge.sampling_params import SamplingParams
from forge.structured import json_schema_grammar

STORIES = ["Write a short story about a dragon who learns to bake bread.", "Write a poem about the winter sea.",
           "Describe your ideal weekend in a cabin.", "Invent a new board game and explain its rules."]
INVOICE = ("Invoice 2291 from Harbour Supplies Ltd, 14 Quay Street, Falmouth, dated 3 March 2024. Items: 12 brass "
           "hinges at 2.40 each, 3 tins of marine varnish at 18.75 each, 1 coil of rope at 42.00. Total due: 127.05, "
           "payable to Harbour Supplies Ltd within 30 days.")
ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "quantity", "price"],
        "properties": {"name": {"type": "string"}, "quantity": {"type": "integer"}, "price": {"type": "number"}}}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["number", "seller", "address", "date", "items", "total"],
          "properties": {"number": {"type": "integer"}, "seller": {"type": "string"}, "address": {"type": "string"},
                         "date": {"type": "string"}, "total": {"type": "number"},
                         "items": {"type": "array", "items": ITEM}}}


def timed(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[int, float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def chat(llms: dict[str, LLM], rounds: int) -> None:
    totals = {spec: [0, 0.0] for spec in llms}
    for _ in range(rounds):
        for q in STORIES:
            for spec, llm in llms.items():
                n, dt = timed(llm, [llm.chat_prompt([{"role": "user", "content": q}])],
                              [SamplingParams(max_tokens=128, temperature=0)])
                totals[spec][0] += n
                totals[spec][1] += dt
    for spec, (n, dt) in totals.items():
        s = llms[spec].engine.core.spec
        kept = f", {s.num_accepted_tokens} of {s.num_draft_tokens} guesses kept" if s.num_draft_tokens else ""
        print(f"chat  {spec:5s} {n / dt:6.1f} tok/s over {n} tokens{kept}")


def json_extraction(llms: dict[str, LLM], rounds: int) -> None:
    grammar = json_schema_grammar(SCHEMA, param="schema")
    for rnd in range(rounds):
        texts = {}
        for spec, llm in llms.items():
            prompt = llm.chat_prompt([{"role": "user", "content": f"{INVOICE}\n\nExtract the invoice as JSON."}])
            params = [SamplingParams(max_tokens=200, temperature=0, grammar=grammar),
                      SamplingParams(max_tokens=200, temperature=0.8, seed=3, grammar=grammar)]
            t0 = time.perf_counter()
            outs = llm.generate([prompt, prompt], params)
            dt = time.perf_counter() - t0
            texts[spec] = [o.text for o in outs]
            print(f"json  {spec:5s} round {rnd}  {sum(len(o.token_ids) for o in outs) / dt:6.1f} tok/s")
        print(f"json  round {rnd}: same output with and without guesses: {texts['off'] == texts['ngram']}")


def rows(loaded: LoadedModel) -> None:
    layer = loaded.model.weights.layers[0]
    for m in (1, 2, 5, 8):
        total = 0.0
        for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
            x = np.random.default_rng(0).standard_normal((m, w.shape[0])).astype(np.float32)
            for _ in range(5):
                w.matmul(x)
            t0 = time.perf_counter()
            for _ in range(200):
                w.matmul(x)
            total += (time.perf_counter() - t0) / 200
        print(f"rows  {m} row(s): one layer's four products {total * 1e6:6.0f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="chat, json, rows [all]")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.cases = args.cases or ["chat", "json", "rows"]
    if set(args.cases) - {"chat", "json", "rows"}:
        ap.error(f"cases are chat, json and rows; got {args.cases}")
    llms = {spec: LLM(config=EngineConfig(speculative=spec), progress=lambda _message: None)
            for spec in ("off", "ngram")}
    if "chat" in args.cases:
        chat(llms, args.rounds)
    if "json" in args.cases:
        json_extraction(llms, args.rounds)
    if "rows" in args.cases:
        rows(llms["off"].loaded)


if __name__ == "__main__":
    main()
