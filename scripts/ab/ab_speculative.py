"""Speculative decoding offline (no HTTP), A B A B: the figures docs/benchmarks.md quotes beside the
serving runs.

    chat     chat prompts that ask for new text (a story, a poem, a plan, a game's rules), one at a
             time, greedy, 128 tokens: output tok/s with --speculative off and ngram, and the share
             of guesses kept
    json     an invoice extracted to JSON under a schema (greedy and seeded, 2 sequences): the same
    rows     what a step with guesses pays for: one layer's four quantized products at 1, 2, 5 and
             8 rows (onnxruntime's one-row path against its several-row one)
    lookahead  input-grounded prompts (forge bench's "task" kind) run offline at 1, 4, 8, 16 and 32
             sequences at once, greedy, 128 tokens without eos: output tok/s with at most 1, 2, 4 and 8
             guesses per sequence (no crowd cap), against --speculative off
    draft    the draft-model proposer on the chat prompts: how often the model's first N layers
             pick the whole model's greedy token (what --draft-layers N can keep), and output tok/s
             with --speculative off, --draft-layers 8, and the model as its own --draft-model (every
             guess kept: what the machinery costs when the draft costs as much as the target)

    .venv/bin/python scripts/ab/ab_speculative.py [chat json rows lookahead draft] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from forge.config import EngineConfig
from forge.llm import LLM, LLMEngine, LoadedModel
from forge.models.forward_batch import ForwardBatch
from forge.models.llama import LlamaModel
from forge.sampling.sampling_params import SamplingParams
from forge.sampling.structured import json_schema_grammar

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


def lookahead(loaded: LoadedModel, rounds: int) -> None:
    from forge.engine import scheduler
    from forge_bench import loadgen

    prompts = [w.prompt for w in loadgen.build_workload(loaded.tokenizer, num_requests=32, max_tokens=128,
                                                        kinds=("task",)).items]
    crowd = scheduler.CROWD
    scheduler.CROWD = 1 << 30               # every arm guesses its own number, however many decode
    try:
        for streams in (1, 4, 8, 16, 32):
            arms = [("off", 1)] + [("ngram", k) for k in (1, 2, 4, 8)]
            rates: dict[str, list[float]] = {}
            for _ in range(rounds):
                for spec, k in arms:
                    eng = LLMEngine(loaded, EngineConfig(speculative=spec, num_speculative_tokens=k,
                                                         max_num_seqs=streams, kv_cache_memory=2**30))
                    n, t0 = 0, time.perf_counter()
                    for i, prompt in enumerate(prompts[: max(4, streams)]):
                        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
                    while eng.has_work():
                        n += sum(len(ev.token_ids) for ev in eng.step())
                    name = "off" if spec == "off" else f"{k} guesses"
                    rates.setdefault(name, []).append(n / (time.perf_counter() - t0))
            print(f"lookahead {streams:2d} streams: " + ", ".join(
                f"{name} {' / '.join(f'{r:.1f}' for r in rs)}" for name, rs in rates.items()) + " tok/s", flush=True)
    finally:
        scheduler.CROWD = crowd


def first_layers_agreement(loaded: LoadedModel, depths: list[int]) -> None:
    """Share of the whole model's greedy tokens (96 per chat prompt) that its first N layers, its
    final norm and head on top, also rank first, given the same text before them."""
    llm_off = LLMEngine(loaded, EngineConfig(speculative="off"))
    model = loaded.model
    texts = []
    for i, q in enumerate(STORIES):
        prompt = loaded.chat_template.render([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = llm_off.add_request(f"q{i}", prompt, SamplingParams(max_tokens=96, temperature=0))
        texts.append((ids, []))
    while llm_off.has_work():
        for ev in llm_off.step():
            texts[int(ev.request_id[1:])][1].extend(ev.token_ids)
    for depth in depths:
        cut = LlamaModel(dataclasses.replace(model.config, num_layers=depth),
                         dataclasses.replace(model.weights, layers=model.weights.layers[:depth]))
        agree = total = 0
        for prompt_ids, output in texts:
            ids = prompt_ids + output
            n, blocks = len(ids), -(-len(ids) // 16)
            batch = ForwardBatch(token_ids=np.asarray(ids, np.int64), positions=np.arange(n),
                                 slot_mapping=np.arange(n), query_start=np.array([0, n]), context_lens=np.array([n]),
                                 block_tables=np.arange(blocks)[None, :],
                                 sample_indices=np.arange(len(prompt_ids) - 1, n - 1))
            picks = cut.forward(batch, cut.new_kv_cache(blocks, 16)).argmax(axis=1)
            agree += int((picks == np.asarray(output)).sum())
            total += len(output)
        print(f"draft first {depth:2d} of {model.config.num_layers} layers agree on {agree / total:5.1%} of "
              f"{total} greedy tokens")


def draft(loaded: LoadedModel, rounds: int) -> None:
    first_layers_agreement(loaded, [4, 8, 16, 24, 28])
    arms = {"off": EngineConfig(speculative="off"),
            "layers8": EngineConfig(speculative="draft", draft_layers=8),
            "itself": EngineConfig(speculative="draft", draft_model=loaded.path)}
    chat({name: LLM.from_loaded(loaded, config, loaded if config.draft_model else None)
          for name, config in arms.items()}, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="chat, json, rows, lookahead, draft [all]")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cases = ["chat", "json", "rows", "lookahead", "draft"]
    args.cases = args.cases or cases
    if set(args.cases) - set(cases):
        ap.error(f"cases are {', '.join(cases)}; got {args.cases}")
    llms = {spec: LLM(config=EngineConfig(speculative=spec), progress=lambda _message: None)
            for spec in ("off", "ngram")}
    if "chat" in args.cases:
        chat(llms, args.rounds)
    if "json" in args.cases:
        json_extraction(llms, args.rounds)
    if "rows" in args.cases:
        rows(llms["off"].loaded)
    if "lookahead" in args.cases:
        lookahead(llms["off"].loaded, args.rounds)
    if "draft" in args.cases:
        draft(llms["off"].loaded, args.rounds)


if __name__ == "__main__":
    main()
