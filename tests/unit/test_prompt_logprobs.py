"""Prompt logprobs in the engine (SamplingParams.prompt_logprobs) and prompt-only requests (max_tokens 0).

A prompt token's logprob is what the model gives it after the tokens before it: checked against a float64
numpy reference of the default model, and by teacher forcing (the prompt P + a greedy continuation of P
scores the continuation's tokens as they were generated: the first one, computed in the same prefill,
exactly; the later ones, which decode computed one at a time, within float rounding). Chunked prefill and
a preemption score each position once; such a prompt takes no prefix-cache hit; the other sequences of the
step are untouched; nothing is kept afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forge.config import EngineConfig
from forge.engine.prompt_scoring import PromptScoring
from forge.errors import EngineError, InvalidRequest, PromptTooLong
from forge.llm import LLM, Completion, LLMEngine, LoadedModel
from forge.messages import SampledToken, SeqChunk
from forge.models.llama.kv_cache import KVCache
from forge.sampling.sampling_params import SamplingParams
from tests.unit.test_llama import reference_hidden

TEXT = "The history of the bicycle is a story of small improvements that added up to a machine which"
# A position computed in a prompt's prefill and the same position computed by a decode step: with a float32
# K/V cache a few 1e-6 apart on the default model (their attention sums in other orders); with the default
# float16 cache up to a few 1e-4.
DECODE_TOLERANCE = {"float32": 2e-5, "float16": 2e-3}
# float32 against float64 through 30 layers: up to 1.5e-3 apart on TEXT.
REFERENCE_TOLERANCE = 5e-3


@pytest.fixture(scope="module")
def loaded(default_model_path: Path) -> LoadedModel:
    return LoadedModel.load(default_model_path, progress=lambda message: None)


def llm(loaded: LoadedModel, **config: object) -> LLM:
    return LLM.from_loaded(loaded, EngineConfig(**config))   # type: ignore[arg-type]


def assert_idle_and_empty(engine: LLMEngine) -> None:
    assert not engine.has_work()
    assert engine.allocator.free_blocks() == engine.allocator.total_blocks()
    assert not engine.allocator.sequences()
    assert engine.runner.num_tracked() == 0
    assert not any(engine.core.tracked().values())


def scored(out: Completion) -> list[float]:
    """The prompt's logprobs after its first token (which has none)."""
    first, *rest = out.prompt_logprobs
    assert first.logprob is None and first.top_logprobs == () and first.rank is None
    return [t.logprob for t in rest if t.logprob is not None]


def test_prompt_logprobs_match_the_float64_reference(loaded: LoadedModel, default_model_path: Path) -> None:
    ids = loaded.tokenizer.encode(TEXT)
    [out] = llm(loaded).generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=5))
    hidden, head = reference_hidden(default_model_path, ids)                  # [n, H], [V, H] float64
    logits = hidden @ head.T                                                  # [n, V]
    log_softmax = logits - logits.max(axis=1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(axis=1, keepdims=True))
    assert [t.token_id for t in out.prompt_logprobs] == ids
    expected = log_softmax[np.arange(len(ids) - 1), ids[1:]]                  # row p scores token p + 1
    np.testing.assert_allclose(scored(out), expected, atol=REFERENCE_TOLERANCE)
    for p, token in enumerate(out.prompt_logprobs[1:]):
        row = log_softmax[p]
        best = np.argsort(-row, kind="stable")
        if row[best[0]] - row[best[1]] > 1e-2:
            assert token.top_logprobs[0][0] == best[0], p
        rank = int(np.count_nonzero(row >= row[ids[p + 1]]))               # vLLM's: the token itself counts
        assert token.rank is not None and abs(token.rank - rank) <= max(2, rank // 50), p


@pytest.mark.parametrize(("budget", "kv_dtype"), [(512, "float32"), (8, "float32"), (512, "float16")])
def test_teacher_forcing_scores_a_continuation_as_it_was_generated(loaded: LoadedModel, budget: int,
                                                                    kv_dtype: str) -> None:
    model = llm(loaded, max_num_batched_tokens=budget, enable_prefix_caching=False, kv_cache_dtype=kv_dtype)
    tolerance = DECODE_TOLERANCE[kv_dtype]
    prompt = loaded.tokenizer.encode(TEXT)
    [gen] = model.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, logprobs=3))
    assert len(gen.token_ids) == 24
    [forced] = model.generate([prompt + gen.token_ids], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert forced.finish_reason == "length" and forced.token_ids == []
    continuation = forced.prompt_logprobs[len(prompt):]
    assert [t.token_id for t in continuation] == gen.token_ids
    if budget >= len(prompt):     # the first token's row ran in the same prefill chunk: the same bits
        assert continuation[0].logprob == gen.logprobs[0].logprob
        assert continuation[0].top_logprobs == gen.logprobs[0].top_logprobs
    for made, again in zip(gen.logprobs, continuation, strict=True):
        assert made.logprob is not None and again.logprob is not None
        assert abs(made.logprob - again.logprob) < tolerance
        gap = made.top_logprobs[0][1] - made.top_logprobs[1][1]
        if gap > tolerance:                     # greedy: the generated token was the likeliest
            assert again.rank == 1 and again.top_logprobs[0][0] == made.token_id
    assert_idle_and_empty(model.engine)


def test_chunked_prefill_scores_every_position_once(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode(TEXT * 2)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    [whole] = llm(loaded, max_num_batched_tokens=512, kv_cache_dtype="float32").generate([ids], params)
    [pieces] = llm(loaded, max_num_batched_tokens=7, kv_cache_dtype="float32").generate([ids], params)
    assert [t.token_id for t in pieces.prompt_logprobs] == ids
    np.testing.assert_allclose(scored(pieces), scored(whole), atol=DECODE_TOLERANCE["float32"])


def test_preempted_sequences_score_their_prompt_once(loaded: LoadedModel) -> None:
    per_block = KVCache.bytes_per_block(loaded.model.config, 4)
    texts = [TEXT, "Once upon a time, in a small village by the sea,", "The three primary colors are", TEXT * 2]
    prompts = [loaded.tokenizer.encode(t) for t in texts] * 2
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    roomy = llm(loaded, enable_prefix_caching=False, kv_cache_dtype="float32").generate(prompts, params)
    tight = LLM.from_loaded(loaded, EngineConfig(kv_cache_dtype="float32", block_size=4, max_model_len=128,
                                                 kv_cache_memory=48 * per_block))
    squeezed = tight.generate(prompts, params)
    assert tight.engine.core.stats().num_preemptions > 0
    for ids, a, b in zip(prompts, roomy, squeezed, strict=True):
        assert [t.token_id for t in b.prompt_logprobs] == ids
        np.testing.assert_allclose(scored(b), scored(a), atol=DECODE_TOLERANCE["float32"])
    assert_idle_and_empty(tight.engine)


def test_prompt_only_requests_end_at_their_prompt_and_take_no_cache_hit(loaded: LoadedModel) -> None:
    model = llm(loaded)
    ids = loaded.tokenizer.encode(TEXT * 2)
    [first] = model.generate([ids], SamplingParams(max_tokens=4, temperature=0.0))
    events = []
    model.engine.add_request("scored", ids, SamplingParams(max_tokens=0, prompt_logprobs=1))
    model.engine.add_request("plain", ids, SamplingParams(max_tokens=0))       # runs its prompt, from the cache
    while model.engine.has_work():
        events.extend(model.engine.step())
    ends = {e.request_id: e for e in events if e.finish_reason is not None}
    assert all(e.token_ids == () for e in events)
    assert ends["scored"].finish_reason == ends["plain"].finish_reason == "length"
    assert ends["scored"].counts.cached == 0 and ends["plain"].counts.cached >= 16
    assert len(ends["scored"].prompt_logprobs) == len(ids) and ends["plain"].prompt_logprobs == ()
    assert first.token_ids
    assert_idle_and_empty(model.engine)


def test_a_scored_prompt_leaves_the_rest_of_its_step_untouched(loaded: LoadedModel) -> None:
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time,", TEXT)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    alone = llm(loaded, enable_prefix_caching=False).generate(prompts, greedy)
    mixed = llm(loaded, enable_prefix_caching=False).generate(
        [*prompts, prompts[2] + alone[2].token_ids, prompts[0]],
        [greedy] * 3 + [SamplingParams(max_tokens=0, prompt_logprobs=4), SamplingParams(
            max_tokens=3, temperature=0.0, prompt_logprobs=0, logprobs=1)])
    def drawn(out: Completion) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
        return [(t.token_id, t.logprob, t.top_logprobs) for t in out.logprobs]

    for a, m in zip(alone, mixed, strict=False):
        assert m.token_ids == a.token_ids and drawn(m) == drawn(a) and m.prompt_logprobs == []
    assert len(mixed[3].prompt_logprobs) == len(prompts[2]) + 12
    generated_and_scored = mixed[4]
    assert generated_and_scored.token_ids == alone[0].token_ids[:3]
    assert [t.token_id for t in generated_and_scored.prompt_logprobs] == prompts[0]
    assert all(t.top_logprobs == () for t in generated_and_scored.prompt_logprobs)


def test_logit_bias_shows_in_prompt_logprobs_as_in_sampled_ones(loaded: LoadedModel) -> None:
    ids = loaded.tokenizer.encode(TEXT)
    model = llm(loaded)
    [plain] = model.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1))
    [banned] = model.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=1, logit_bias=((ids[3], -100.0),)))
    assert banned.prompt_logprobs[3].logprob == float("-inf") and plain.prompt_logprobs[3].logprob > -30
    assert banned.prompt_logprobs[3].rank == loaded.model.config.vocab_size


def test_limits_of_prompt_only_requests(loaded: LoadedModel) -> None:
    engine = LLMEngine(loaded, EngineConfig(max_model_len=32))
    [one] = LLM.from_loaded(loaded).generate([[42]], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert one.prompt_logprobs == [SampledToken(seq_id=one.prompt_logprobs[0].seq_id, token_id=42)]
    engine.add_request("fits", [1] * 32, SamplingParams(max_tokens=0, prompt_logprobs=0))   # the whole context
    with pytest.raises(PromptTooLong):
        engine.add_request("long", [1] * 33, SamplingParams(max_tokens=0))
    with pytest.raises(PromptTooLong, match="leaving no room"):
        engine.add_request("full", [1] * 32, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest) as bad:
        engine.add_request("k", [1], SamplingParams(max_tokens=0, prompt_logprobs=21))
    assert bad.value.param == "prompt_logprobs"
    while engine.has_work():
        engine.step()
    assert_idle_and_empty(engine)


def test_a_preempted_prompt_scores_only_what_it_had_not() -> None:
    scoring = PromptScoring(prompt_ids=tuple(range(10, 20)), num_top=0)

    def chunk(start: int, n: int) -> SeqChunk:
        return SeqChunk(seq_id=0, token_ids=(1,) * n, start=start, block_ids=(0,), samples=False, num_output_tokens=0)

    assert scoring.rows(chunk(0, 4)) == (0, 4)               # rows 0..3 score tokens 1..4

    def head(hidden: np.ndarray) -> np.ndarray:
        return np.zeros((len(hidden), 32), np.float32)

    part = scoring.score(0, np.zeros((4, 8), np.float32), head)
    assert part.start == 1 and [t.token_id for t in part.tokens] == [11, 12, 13, 14]
    assert scoring.rows(chunk(0, 6)) == (4, 6)               # recomputed from the start: rows 4, 5 are new
    scoring.score(0, np.zeros((2, 8), np.float32), head)
    assert scoring.rows(chunk(6, 4)) == (0, 3)               # the last prompt position scores nothing
    scoring.score(0, np.zeros((3, 8), np.float32), head)
    assert scoring.done and scoring.rows(chunk(10, 1)) == (0, 0)
    with pytest.raises(EngineError, match="never computed"):
        PromptScoring(prompt_ids=(1, 2, 3), num_top=0).rows(chunk(1, 2))
