"""The seed's forge-bench: the toy Engine and the one-sequence SpeculativeDecoder on TinyTransformer.

Figures only; nothing here asserts speed. The real model's offline bench is forge.offline_bench.
"""

from __future__ import annotations

import random
import time
from typing import Any

from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_engine import Engine
from forge.seed.toy_model import TinyTransformer
from forge.seed.toy_scheduler import SchedulerConfig
from forge.seed.toy_speculative import SpeculativeDecoder


def toy_bench(*, num_requests: int = 64, prompt_len: int = 32, max_new: int = 64,
              num_blocks: int = 256, block_size: int = 16, max_batch_size: int = 8,
              lookahead: int = 4, vocab: int = 320, layers: int = 2, seed: int = 0) -> dict[str, Any]:
    """Run requests through the Engine and the SpeculativeDecoder with TinyTransformer."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(prompt_len)] for _ in range(num_requests)]
    model = TinyTransformer(vocab, layers)
    engine = Engine(model, SchedulerConfig(max_batch_size=max_batch_size),
                    PagedKVCache(num_blocks, block_size))
    for i, prompt in enumerate(prompts):
        engine.submit(i, prompt, max_new)
    t0 = time.perf_counter()
    num_steps = 0
    while engine.scheduler.has_work():
        engine.step()
        num_steps += 1
    outputs = engine.run_to_completion()
    engine_s = time.perf_counter() - t0
    num_tokens = sum(len(o.tokens) for o in outputs)

    decoder = SpeculativeDecoder(TinyTransformer.draft(vocab, layers), model, lookahead)
    t0 = time.perf_counter()
    spec_tokens, rates = 0, []
    for prompt in prompts:
        tokens, rate = decoder.generate(prompt, max_new)
        spec_tokens += len(tokens)
        rates.append(rate)
    spec_s = time.perf_counter() - t0
    return {
        "mode": "toy",
        "requests": num_requests, "prompt_len": prompt_len, "max_new": max_new,
        "engine": {"tokens": num_tokens, "seconds": round(engine_s, 4),
                   "tokens_per_s": round(num_tokens / engine_s, 1) if engine_s else None,
                   "steps": num_steps, "preemptions": engine.scheduler.num_preemptions},
        "speculative": {"tokens": spec_tokens, "seconds": round(spec_s, 4),
                        "tokens_per_s": round(spec_tokens / spec_s, 1) if spec_s else None,
                        "lookahead": lookahead,
                        "acceptance_rate": round(sum(rates) / len(rates), 4) if rates else 0.0},
    }


def format_toy(result: dict[str, Any]) -> str:
    e, s = result["engine"], result["speculative"]
    return "\n".join([
        f"toy bench: {result['requests']} requests, prompt {result['prompt_len']}, "
        f"max_new {result['max_new']}",
        f"  engine       {e['tokens_per_s']:>10} tok/s  {e['tokens']} tokens  {e['steps']} steps  "
        f"{e['preemptions']} preemptions",
        f"  speculative  {s['tokens_per_s']:>10} tok/s  lookahead {s['lookahead']}  "
        f"acceptance {s['acceptance_rate']:.1%}",
    ])
