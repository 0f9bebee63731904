"""The grammar engine A/B behind docs/design.md ("Constrained decoding"): llguidance vs outlines-core on
forge's tokenizer, for a few JSON schemas: time to compile (what the first request with a new schema waits)
and time per token mask along a random walk through the grammar.

outlines-core is not a forge dependency: `.venv/bin/pip install outlines-core`, then
    .venv/bin/python scripts/ab/ab_grammar_engines.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import outlines_core as oc

from forge.models import hub
from forge.sampling.structured import Grammars, allowed_tokens, json_schema_grammar
from forge.text.tokenizer import Tokenizer

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "address"],
        "properties": {
            "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 5},
            "address": {"type": "object", "required": ["city", "zip"],
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        },
    },
    "order": {
        "type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
        "properties": {
            "id": {"type": "integer"}, "status": {"enum": ["new", "paid", "shipped"]},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                               "price": {"type": "number", "minimum": 0}}}},
        },
    },
    "any object": {"type": "object"},
}
STEPS = 60


def walk(mask_of: Callable[[], np.ndarray], advance: Callable[[int], None], eos: int,
         rng: np.random.Generator) -> list[float]:
    """Seconds per mask along a random walk of allowed tokens (the end token only when nothing else is)."""
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        allowed = np.flatnonzero(mask_of())
        times.append(time.perf_counter() - t0)
        choices = allowed[allowed != eos]
        if choices.size == 0:
            break
        advance(int(rng.choice(choices)))
    return times


def main() -> None:
    tok = Tokenizer.from_gguf(hub.default_model_path())
    vocab, eos = tok.vocab_size, tok.eos_token_id or 0
    t0 = time.perf_counter()
    grammars = Grammars(tok)
    print(f"llguidance vocabulary: {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for i in range(vocab):
        if i != eos:
            table.setdefault(tok.token_bytes(i), []).append(i)
    vocabulary = oc.Vocabulary(eos, table)
    print(f"outlines-core vocabulary: {time.perf_counter() - t0:.2f} s")
    for name, schema in SCHEMAS.items():
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        matcher = grammars.matcher(json_schema_grammar(schema, param="schema"))
        compile_s = time.perf_counter() - t0
        times = walk(lambda m=matcher: allowed_tokens(grammars.fill_masks([m])[0], vocab),
                     lambda t, m=matcher: m.consume_token(t), eos, rng)
        print(f"{name:11s} llguidance     compile {compile_s * 1e3:9.1f} ms   mask p50 {np.median(times) * 1e6:6.0f} us"
              f"   max {max(times) * 1e6:6.0f} us")
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        guide = oc.Guide(oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(schema)), vocabulary))
        compile_s = time.perf_counter() - t0
        bitmask = np.zeros((vocab + 31) // 32, np.int32)

        def mask(g: Any = guide, b: np.ndarray = bitmask) -> np.ndarray:
            g.write_mask_into(b.ctypes.data, b.size, 4)
            return allowed_tokens(b, vocab)

        times = walk(mask, lambda t, g=guide: g.advance(t), eos, rng)
        print(f"{name:11s} outlines-core  compile {compile_s * 1e3:9.1f} ms   mask p50 {np.median(times) * 1e6:6.0f} us"
              f"   max {max(times) * 1e6:6.0f} us")
    matchers = [grammars.matcher(json_schema_grammar(SCHEMAS["order"], param="schema")) for _ in range(32)]
    t0 = time.perf_counter()
    for _ in range(50):
        grammars.fill_masks(matchers)
    print(f"llguidance: 32 masks in one call: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
