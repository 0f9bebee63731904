"""Constrained decoding: grammars from request constraints, masks and logit_bias in the sampler, and the real
model's outputs under a grammar through the engine (preemption, seeds, max_tokens, min_tokens)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from forge.config import EngineConfig
from forge.errors import InvalidRequest
from forge.llm import LLMEngine, LoadedModel
from forge.models.llama import KVCache
from forge.sampling.penalties import TokenHistory
from forge.sampling.sampler import Sampler, SamplingBatch
from forge.sampling.sampling_params import SamplingParams
from forge.sampling.structured import (
    MAX_CONSTRAINT_CHARS,
    Closing,
    Grammars,
    allowed_tokens,
    choice_grammar,
    json_schema_grammar,
    lark_grammar,
    regex_grammar,
)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}}}}


def engine(loaded: LoadedModel, *, num_blocks: int = 512, block_size: int = 4, **kwargs: object) -> LLMEngine:
    per_block = KVCache.bytes_per_block(loaded.model.config, block_size)
    config = EngineConfig(kv_cache_dtype="float32",
                          block_size=block_size, kv_cache_memory=num_blocks * per_block, max_model_len=256,
                          **kwargs)  # type: ignore[arg-type]
    return LLMEngine(loaded, config)


def generate(eng: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> dict[str, tuple[str, str]]:
    """request id -> (text, finish reason), for prompts run together."""
    tok = eng.tokenizer
    ids = {f"r{i}": eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))}
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str] = {}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].extend(ev.token_ids)
            if ev.finish_reason is not None:
                reasons[ev.request_id] = ev.finish_reason
    return {rid: (tok.decode(toks), reasons[rid]) for rid, toks in out.items()}


def chat(loaded: LoadedModel, text: str) -> str:
    return loaded.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True)


# ---- grammars from constraints ---------------------------------------------------------------------------

def test_constraints_that_cannot_be_read_or_compiled_are_invalid_requests(grammars: Grammars) -> None:
    with pytest.raises(InvalidRequest, match="not valid JSON") as exc:
        json_schema_grammar("{nope", param="guided_json")
    assert exc.value.param == "guided_json"
    with pytest.raises(InvalidRequest, match="must be an object"):
        json_schema_grammar([1, 2], param="p")
    with pytest.raises(InvalidRequest, match="too large"):
        regex_grammar("a" * (MAX_CONSTRAINT_CHARS + 1), param="guided_regex")
    with pytest.raises(InvalidRequest, match="non-empty"):
        choice_grammar([], param="guided_choice")
    for grammar in (json_schema_grammar({"type": "strin"}, param="p"), regex_grammar("[a-", param="p"),
                    json_schema_grammar({"$ref": "#/missing"}, param="p")):
        with pytest.raises(InvalidRequest, match="cannot be compiled") as exc:
            grammars.check(grammar, param="response_format")
        assert exc.value.param == "response_format"
    with pytest.raises(InvalidRequest):
        grammars.check(lark_grammar("start: foo", param="p"))          # a rule never defined
    grammars.check(lark_grammar('root ::= "yes" | "no"', param="p"))       # llama.cpp's GBNF is read too


def test_a_matcher_allows_exactly_the_grammar(real: LoadedModel, grammars: Grammars) -> None:
    tok = real.tokenizer
    matcher = grammars.matcher(choice_grammar(["yes", "no"], param="p"))
    allowed = allowed_tokens(grammars.fill_masks([matcher])[0], tok.vocab_size)       # [V]
    texts = {tok.token_str(int(t)) for t in np.flatnonzero(allowed)}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert not any(allowed[sorted(tok.special_ids)])                   # nothing special before the end
    [yes] = tok.encode("yes", add_special_tokens=False)
    assert matcher.consume_token(yes)
    allowed = allowed_tokens(grammars.fill_masks([matcher])[0], tok.vocab_size + 7)   # padded logits
    assert np.flatnonzero(allowed).tolist() == [tok.eos_token_id]      # done: only the end may follow
    # Each matcher is its own: a second one for the same grammar starts at the beginning.
    fresh = grammars.matcher(choice_grammar(["yes", "no"], param="p"))
    assert allowed_tokens(grammars.fill_masks([fresh])[0], tok.vocab_size)[yes]


# ---- the sampler ------------------------------------------------------------------------------------------

def batch(params: list[SamplingParams], allowed: list[np.ndarray | None] | None = None,
          seed: int = 0) -> SamplingBatch:
    return SamplingBatch(params=params, generators=[np.random.default_rng(seed + i) for i in range(len(params))],
                         counts=[TokenHistory([1, 2]) if p.has_penalties else None for p in params],
                         num_output_tokens=[0] * len(params), allowed=allowed or ())


def test_masked_tokens_are_never_drawn_and_logprobs_are_of_the_masked_distribution() -> None:
    rng = np.random.default_rng(7)
    vocab = 1000
    logits = rng.normal(0, 3, (4, vocab)).astype(np.float32)              # [4, V]
    masks = [rng.random(vocab) < 0.05 for _ in range(3)] + [None]
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0, logprobs=5),
              SamplingParams(temperature=1.5, top_p=0.9, top_k=50, repetition_penalty=1.3, logprobs=5),
              SamplingParams(temperature=1.0, logprobs=5)]
    sampler = Sampler(eos_token_id=0)
    before = logits.copy()
    for seed in range(50):
        out = sampler.sample(logits, batch(params, masks, seed))
        for i, mask in enumerate(masks[:3]):
            assert mask[out.token_ids[i]]
            lp = out.logprobs[i]
            assert lp is not None and all(mask[t] for t, _ in lp.top)
            allowed = logits[i][mask].astype(np.float64)
            expected = logits[i, out.token_ids[i]] - allowed.max() - np.log(np.exp(allowed - allowed.max()).sum())
            assert lp.logprob == pytest.approx(expected, abs=1e-4)
    np.testing.assert_array_equal(logits, before)                          # the model's logits untouched
    probs = sampler.probabilities(logits, batch(params, masks))
    assert probs[1][~masks[1]].max() == 0.0 and probs[1].sum() == pytest.approx(1.0)


def test_logit_bias_shifts_and_bans() -> None:
    logits = np.array([[0.0, 5.0, 4.0, 1.0]], np.float32)
    sampler = Sampler()
    top = SamplingParams(temperature=0.0, logprobs=3)
    assert sampler.sample(logits, batch([top])).token_ids[0] == 1
    banned = SamplingParams(temperature=0.0, logprobs=3, logit_bias=((1, -100.0),))
    out = sampler.sample(logits, batch([banned]))
    assert out.token_ids[0] == 2
    assert out.logprobs[0] is not None and 1 not in [t for t, _ in out.logprobs[0].top]   # banned before logprobs
    boosted = SamplingParams(temperature=0.0, logit_bias=((3, 10.0),))
    assert sampler.sample(logits, batch([boosted])).token_ids[0] == 3
    hot = SamplingParams(temperature=1.0, logit_bias=((1, -100.0), (2, -100.0)))
    assert all(sampler.sample(logits, batch([hot], seed=s)).token_ids[0] in (0, 3) for s in range(40))
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=((4, 1.0),)).validate(vocab_size=4)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=((0, 100.5),)).validate(vocab_size=4)


def test_closing_tokens_depend_on_whether_the_output_is_in_a_string() -> None:
    vocab = [b'"', b'", "', b'"]}', b"]", b" [", b"}}", b"]]", b"abc", b'"name', b'\\"', b"},", b'"a"', b"<e>"]
    closing = Closing(vocab, end_ids=[12])
    names = lambda mask: [vocab[i] for i in np.flatnonzero(mask)]                   # noqa: E731
    # In a string only its closing quote closes (']]' there is text); '", "' ends an item to start the next.
    assert names(closing.in_string) == [b'"', b'"]}', b"<e>"]
    assert names(closing.outside) == [b"]", b"}}", b"]]", b"<e>"]
    state = (False, False)
    for token, in_string in ((8, True), (7, True), (9, True), (1, True), (2, False), (11, False), (10, False)):
        state = closing.advance(state, token)   # '"name' 'abc' '\\"' (escaped) '", "' '"]}' '"a"' '},'
        assert state[0] is in_string, vocab[token]
    assert closing.mask((True, False)) is closing.in_string and closing.mask((False, False)) is closing.outside


# ---- the engine, on the real model -------------------------------------------------------------------------

def test_json_schema_outputs_validate_at_every_temperature(real: LoadedModel) -> None:
    grammar = json_schema_grammar(PERSON, param="p")
    eng = engine(real)
    prompts = [chat(real, f"Describe person number {i} as JSON.") for i in range(6)]
    params = [SamplingParams(max_tokens=80, temperature=t, seed=i, grammar=grammar)
              for i, t in enumerate((0.0, 0.5, 0.8, 1.0, 1.3, 1.0))]
    for text, reason in generate(eng, prompts, params).values():
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert eng.runner.num_tracked() == 0


def test_constraints_compose_with_seeds_preemption_and_limits(real: LoadedModel) -> None:
    grammar = json_schema_grammar(PERSON, param="p")
    prompts = [chat(real, f"Person {i}, as JSON please.") for i in range(8)]
    params = [SamplingParams(max_tokens=60, temperature=0.9, seed=100 + i, grammar=grammar) for i in range(8)]
    roomy = generate(engine(real), prompts, params)
    # A cache too small for all eight at once: sequences are preempted and recomputed mid-JSON, and
    # their matchers carry on where they were.
    tight_engine = engine(real, num_blocks=72, max_num_seqs=8)
    tight = generate(tight_engine, prompts, params)
    assert tight_engine.core.stats().num_preemptions > 0
    for text, reason in tight.values():
        assert reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    assert tight == roomy                                    # seeded: the same draws, whatever the batch did
    # The limit reached before the JSON closes: "length", and what came is a prefix of valid JSON.
    [(short, reason)] = generate(engine(real), prompts[:1], [SamplingParams(max_tokens=4, temperature=0.0,
                                                                            grammar=grammar)]).values()
    assert reason == "length" and short.startswith('{"name": ')
    # min_tokens does not hold the end back once the grammar is done.
    choice = choice_grammar(["yes", "no"], param="p")
    held = SamplingParams(max_tokens=20, min_tokens=10, temperature=0.0, grammar=choice)
    [(text, reason)] = generate(engine(real), [chat(real, "Yes or no?")], [held]).values()
    assert (text, reason) in (("yes", "stop"), ("no", "stop"))


def test_a_json_output_closes_within_its_limit(real: LoadedModel) -> None:
    """Greedy, the model lists colours until the limit; with close_within, the last tokens of max_tokens go
    to the tokens that close the string, the array and the object, and the output parses."""
    schema = {"type": "object", "additionalProperties": False, "required": ["colours"],
              "properties": {"colours": {"type": "array", "items": {"type": "string"}}}}
    grammar = json_schema_grammar(schema, param="p")
    prompts = [chat(real, "Name every colour you know."), chat(real, "List colours.")]
    looping = [SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)] * 2
    assert {reason for _, reason in generate(engine(real), prompts, looping).values()} == {"length"}
    closing = [SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar, close_within=10)] * 2
    ended = generate(engine(real), prompts, closing)
    for text, reason in ended.values():
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
        assert len(real.tokenizer.encode(text, add_special_tokens=False)) <= 40
    assert generate(engine(real), prompts, looping)["r0"][0][:40] == ended["r0"][0][:40]    # the same until then


def test_regex_and_grammar_constraints_hold(real: LoadedModel) -> None:
    phone = regex_grammar(r"\+1-\d{3}-\d{3}-\d{4}", param="p")
    date = lark_grammar('start: year "-" month\nyear: /20[0-9][0-9]/\nmonth: "0" /[1-9]/ | "1" /[0-2]/',
                        param="p")
    eng = engine(real)
    out = generate(eng, [chat(real, "A phone number?"), chat(real, "A month?")] * 2,
                   [SamplingParams(max_tokens=30, temperature=0.0, grammar=phone),
                    SamplingParams(max_tokens=30, temperature=0.0, grammar=date),
                    SamplingParams(max_tokens=30, temperature=1.2, seed=1, grammar=phone),
                    SamplingParams(max_tokens=30, temperature=1.2, seed=2, grammar=date)])
    assert all(reason == "stop" for _, reason in out.values())
    for rid in ("r0", "r2"):
        assert re.fullmatch(r"\+1-\d{3}-\d{3}-\d{4}", out[rid][0])
    for rid in ("r1", "r3"):
        assert re.fullmatch(r"20\d\d-(0[1-9]|1[0-2])", out[rid][0])


def test_unconstrained_neighbours_are_unchanged(real: LoadedModel) -> None:
    """A constrained sequence in the batch changes nothing for the others (greedy, token for token)."""
    prompts = [chat(real, "Name three colours."), chat(real, "Count to five.")]
    plain = SamplingParams(max_tokens=16, temperature=0.0)
    alone = generate(engine(real), prompts, [plain, plain])
    mixed = generate(engine(real), [*prompts, chat(real, "JSON?")],
                     [plain, plain, SamplingParams(max_tokens=40, temperature=0.0,
                                                   grammar=json_schema_grammar(PERSON, param="p"))])
    assert (mixed["r0"], mixed["r1"]) == (alone["r0"], alone["r1"])


def test_a_bad_grammar_is_refused_at_add_request(real: LoadedModel) -> None:
    eng = engine(real)
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        eng.add_request("bad", "hi", SamplingParams(grammar=regex_grammar("(", param="p")))
    assert not eng.has_work()


def test_masks_after_drafts_are_the_masks_after_consuming_them(real: LoadedModel, grammars: Grammars) -> None:
    """Speculative decoding's rows under a grammar: row j is what the grammar allows after drafts[:j];
    rows past a draft the grammar refuses are never used. The matchers end as they began."""
    tok = real.tokenizer
    grammar = json_schema_grammar(PERSON, param="p")
    drafts = tok.encode('{"name": "Ann", "age"', add_special_tokens=False)
    plain, drafting = grammars.matcher(grammar), grammars.matcher(grammar)
    rows = grammars.fill_masks([plain, drafting], [[], drafts])                  # [1 + 1 + len(drafts), W]
    assert rows.shape[0] == 2 + len(drafts)
    reference = grammars.matcher(grammar)
    for j in range(len(drafts) + 1):
        np.testing.assert_array_equal(rows[1 + j], grammars.fill_masks([reference])[0])
        if j < len(drafts):
            assert reference.consume_token(drafts[j])
    np.testing.assert_array_equal(rows[0], grammars.fill_masks([drafting])[0])  # both still at the start


INVOICE = ("Invoice 2291 from Harbour Supplies Ltd, 14 Quay Street, Falmouth, dated 3 March 2024. Items: 12 brass "
           "hinges at 2.40 each, 3 tins of marine varnish at 18.75 each, 1 coil of rope at 42.00. Total due: "
           "127.05, payable to Harbour Supplies Ltd within 30 days.")
INVOICE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["number", "seller", "address", "items", "total"],
    "properties": {"number": {"type": "integer"}, "seller": {"type": "string", "maxLength": 40},
                   "address": {"type": "string", "maxLength": 40}, "total": {"type": "number"},
                   "items": {"type": "array", "maxItems": 4, "items": {
                       "type": "object", "additionalProperties": False, "required": ["name", "quantity"],
                       "properties": {"name": {"type": "string", "maxLength": 30}, "quantity": {"type": "integer"}}}}}}


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_constrained_speculation_changes_nothing_but_the_speed(real: LoadedModel, proposer: str) -> None:
    """n-gram guesses, and a draft model's (the model itself, whose guesses know nothing of the
    grammar: one it refuses is rejected where it stands)."""
    grammar = json_schema_grammar(INVOICE_SCHEMA, param="p")
    prompt = chat(real, f"{INVOICE}\n\nExtract the invoice as JSON.")
    params = [SamplingParams(max_tokens=120, temperature=0.0, grammar=grammar),
              SamplingParams(max_tokens=120, temperature=0.8, seed=3, grammar=grammar)]
    plain = generate(engine(real, speculative="off"), [prompt, prompt], params)
    spec_engine = engine(real, speculative=proposer, draft_model=real.path if proposer == "draft" else None)
    spec = generate(spec_engine, [prompt, prompt], params)
    assert spec == plain
    assert spec_engine.core.spec.num_accepted_tokens > 10                 # the drafts were checked and kept
    for text, reason in spec.values():
        if reason == "stop":
            jsonschema.validate(json.loads(text), INVOICE_SCHEMA)

