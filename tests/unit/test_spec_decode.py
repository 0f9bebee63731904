"""Speculative decoding in the batched engine: n-gram proposals, verification that changes no output
(greedy or seeded, real model), the exact distribution (chi-square, tiny model), and the cache's
books across accepted and rejected drafts."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.config import EngineConfig
from forge.errors import ConfigError
from forge.llm import LLMEngine, LoadedModel
from forge.messages import StepBatch, StepOutput
from forge.models.llama import KVCache, LlamaModel
from forge.sampling.sampling_params import SamplingParams
from forge.spec_decode.speculation import Lookahead, SpeculativeConfig, ngram_proposal
from tests.tiny_gguf import load_tiny

TEXT = ("The lighthouse on Gull Rock was built in 1871 by the harbour board. Its lamp burned paraffin until "
        "1934, when an electric lamp replaced it. The keeper, Thomas Reed, kept a log of every ship that "
        "passed, and his daughter Mary rowed out to rescue the crew of the schooner Alba in the storm of 1889.")
CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b
'''
TASKS = [f"{TEXT}\n\nQuote, word for word, the sentence about Mary.",
         f"Rewrite this function with the name fib, changing nothing else:\n\n{CODE}",
         f"{TEXT}\n\nRepeat the first two sentences exactly.",
         "Write a short poem about the sea."]


# ---- the proposer -----------------------------------------------------------------------------------------

def test_ngram_proposal_continues_the_latest_earlier_occurrence() -> None:
    assert ngram_proposal([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], 3) == [4, 5, 6]
    assert ngram_proposal([1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]             # the latest match wins
    assert ngram_proposal([9, 1, 2, 3, 4, 1, 2, 3], 2, max_ngram=3) == [4, 1]
    assert ngram_proposal([1, 2, 3], 4) == []                               # nothing recurs
    assert ngram_proposal([5, 5, 5, 5], 3) == [5]                           # only what exists follows
    assert ngram_proposal([1, 2, 1, 2], 0) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=40), st.integers(1, 6))
def test_a_proposal_is_what_followed_its_match(tokens: list[int], k: int) -> None:
    draft = ngram_proposal(tokens, k, max_ngram=3, min_ngram=2)
    assert len(draft) <= k
    if draft:
        # Some n in [2, 3]: the last n tokens occurred earlier, and the draft followed them there.
        assert any(tokens[i:i + n] == tokens[-n:] and tokens[i + n:i + n + len(draft)] == draft
                   for n in (2, 3) for i in range(len(tokens) - n))


def test_a_sequence_whose_drafts_fail_pauses() -> None:
    look = Lookahead(max_tokens=4)
    assert look.budget() == 4
    look.observe(4, 0)
    assert look.budget() == 4          # one failure: acceptance 0.42, still trying
    look.observe(4, 0)
    assert [look.budget() for _ in range(Lookahead.PAUSE_STEPS)] == [0] * Lookahead.PAUSE_STEPS
    assert look.budget() == 4
    look.observe(4, 0)                  # the try after a pause failed: the next pause is twice as long
    assert [look.budget() for _ in range(2 * Lookahead.PAUSE_STEPS + 1)] == [0] * 2 * Lookahead.PAUSE_STEPS + [4]
    for _ in range(10):
        look.observe(4, 0)
        while look.budget() == 0:
            pass
    assert look.pause == Lookahead.MAX_PAUSE_STEPS
    look.observe(4, 4)                  # a try that went well: pauses start short again
    assert look.pause == 0 and look.budget() == 4
    with pytest.raises(ValueError):
        SpeculativeConfig("medusa")


# ---- the real model: nothing changes but the speed --------------------------------------------------------

def engine(loaded: LoadedModel, spec: str, *, num_blocks: int = 1024, block_size: int = 16,
           draft: LoadedModel | None = None, **kwargs: object) -> LLMEngine:
    """An engine of num_blocks blocks; `draft`: a separate draft model, its K/V in the same blocks."""
    per_block = KVCache.bytes_per_block(loaded.model.config, block_size)
    if draft is not None:
        per_block += KVCache.bytes_per_block(draft.model.config, block_size)
        kwargs["draft_model"] = draft.path
    config = EngineConfig(kv_cache_dtype="float32", block_size=block_size, kv_cache_memory=num_blocks * per_block,
                          max_model_len=min(1024, num_blocks * block_size),
                          speculative=spec, num_speculative_tokens=4, speculative_max_batch=8,
                          **kwargs)  # type: ignore[arg-type]
    return LLMEngine(loaded, config, draft)


def run(eng: LLMEngine, requests: list[tuple[str | list[int], SamplingParams]], *, late: int = 0,
        abort_after: dict[str, int] | None = None) -> dict[str, tuple[list[int], str | None, list[float]]]:
    """request id -> (tokens, finish reason, logprobs); the last `late` requests arrive after 3 steps, so
    their prompts are computed beside decode rows that carry drafts."""
    out: dict[str, tuple[list[int], str | None, list[float]]] = {}
    pending = [(f"r{i}", eng.tokenizer.encode(p) if isinstance(p, str) else p, sp)
               for i, (p, sp) in enumerate(requests)]
    for rid, ids, sp in pending[: len(pending) - late]:
        eng.add_request(rid, ids, sp)
        out[rid] = ([], None, [])
    steps = 0
    while eng.has_work() or steps < 3:
        if steps == 3:
            for rid, ids, sp in pending[len(pending) - late:]:
                eng.add_request(rid, ids, sp)
                out[rid] = ([], None, [])
        for ev in eng.step():
            tokens, _, lps = out[ev.request_id]
            tokens.extend(ev.token_ids)
            lps.extend(t.logprob for t in ev.logprobs if t.logprob is not None)
            out[ev.request_id] = (tokens, ev.finish_reason, lps)
        steps += 1
        for rid, after in (abort_after or {}).items():
            if len(out[rid][0]) >= after and out[rid][1] is None:
                eng.abort(rid)
    return out


def chat(loaded: LoadedModel, text: str) -> str:
    return loaded.chat_template.render([{"role": "user", "content": text}], add_generation_prompt=True)


def test_greedy_and_seeded_output_is_the_plain_engines(real: LoadedModel) -> None:
    requests = [(chat(real, t), SamplingParams(max_tokens=48, temperature=0.0, logprobs=0)) for t in TASKS]
    requests += [(chat(real, TASKS[0]), SamplingParams(max_tokens=40, temperature=0.9, seed=7)),
                 (chat(real, TASKS[1]), SamplingParams(max_tokens=37, temperature=0.6, top_p=0.9, seed=8)),
                 (chat(real, TASKS[2]), SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(13,)))]
    plain = run(engine(real, "off"), requests, late=2)
    spec_engine = engine(real, "ngram")
    spec = run(spec_engine, requests, late=2)
    stats = spec_engine.core.spec
    assert stats.num_drafts > 5 and stats.num_accepted_tokens > 20        # it did speculate, and it paid
    for rid, (tokens, reason, lps) in plain.items():
        assert spec[rid][0] == tokens, rid                                # token for token
        assert spec[rid][1] == reason, rid                                # max_tokens inside a kept run too
        np.testing.assert_allclose(spec[rid][2], lps, atol=2e-3)          # a logprob for every token
    assert spec_engine.allocator.free_blocks() == spec_engine.allocator.total_blocks()
    assert spec_engine.core.tracked() == dict.fromkeys(spec_engine.core.tracked(), 0)


def test_preemption_and_aborts_mid_speculation(real: LoadedModel) -> None:
    requests = [(chat(real, t), SamplingParams(max_tokens=60, temperature=0.0)) for t in TASKS[:3]]
    roomy = run(engine(real, "off"), requests)
    # 24 blocks of 16 tokens: three prompts of ~100 tokens and their outputs cannot all stay.
    tight = engine(real, "ngram", num_blocks=24)
    out = run(tight, requests)
    assert tight.core.stats().num_preemptions > 0 and tight.core.spec.num_accepted_tokens > 0
    assert {rid: v[0] for rid, v in out.items()} == {rid: v[0] for rid, v in roomy.items()}
    assert tight.allocator.free_blocks() == tight.allocator.total_blocks()
    aborting = engine(real, "ngram")
    run(aborting, requests, abort_after={"r0": 5, "r1": 9})
    assert aborting.allocator.free_blocks() == aborting.allocator.total_blocks()
    assert aborting.runner.num_tracked() == 0


def test_no_speculation_where_it_does_not_apply(real: LoadedModel) -> None:
    eng = engine(real, "ngram", max_num_seqs=16)
    eng.core.scheduler.config.speculative = SpeculativeConfig("ngram", 4, max_batch=2)
    # 3 decoding > 2: prompts with no block in common, so that all three are admitted in one step
    # (prompts behind one uncomputed prefix are admitted one after the other)
    many = [(f"Story {n}. {TASKS[0]}", SamplingParams(max_tokens=8, temperature=0.0)) for n in "ABC"]
    run(eng, many)
    penalised = [(chat(real, TASKS[0]), SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.2))]
    run(eng, penalised)
    assert eng.core.spec.num_drafts == 0


# ---- the tiny model: the distribution, exactly ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    loaded: LoadedModel = load_tiny(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=5)
    return loaded


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    x = logits.astype(np.float64) / temperature
    x = np.exp(x - x.max())
    return x / x.sum()


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile at about 1 - 5e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_tokens_follow_the_target_distribution_exactly(tiny: LoadedModel, proposer: str) -> None:
    """The third token's marginal under speculation against the model's exact one: the third token is
    where drafts are verified (the first comes from the prompt's step, the second from the first
    decode row), with a prompt in which every token recurs, so every decode step carries n-gram
    drafts; the draft proposer (the model itself, guessing its most likely tokens) drafts at every
    decode step."""
    prompt = [*range(3, 35), *range(3, 35)]
    temperature = 1.5
    model = tiny.model
    p1 = softmax(model.forward_context(prompt), temperature)                               # [V]
    exact = np.zeros(model.config.vocab_size)
    for t1 in np.flatnonzero(p1 > 1e-4):
        p2 = softmax(model.forward_context([*prompt, int(t1)]), temperature)
        for t2 in np.flatnonzero(p1[t1] * p2 > 1e-5):
            exact += p1[t1] * p2[t2] * softmax(model.forward_context([*prompt, int(t1), int(t2)]), temperature)
    exact /= exact.sum()
    per_block = KVCache.bytes_per_block(model.config, 4) * (2 if proposer == "draft" else 1)
    eng = LLMEngine(tiny, EngineConfig(kv_cache_dtype="float32",
                                       block_size=4, kv_cache_memory=2048 * per_block, max_model_len=128,
                                       max_num_seqs=64, speculative=proposer, speculative_max_batch=64,
                                       draft_model=tiny.path if proposer == "draft" else None),
                    tiny if proposer == "draft" else None)
    eng.core.scheduler.config.speculative = SpeculativeConfig(proposer, 3, min_ngram=1, max_batch=64)
    num = 3000
    counts = np.zeros(model.config.vocab_size)
    for start in range(0, num, 64):
        for i in range(start, min(start + 64, num)):
            eng.add_request(f"s{i}", prompt, SamplingParams(max_tokens=3, temperature=temperature, seed=i,
                                                            ignore_eos=True))
        tokens: dict[str, list[int]] = {}
        while eng.has_work():
            for ev in eng.step():
                tokens.setdefault(ev.request_id, []).extend(ev.token_ids)
        for seq in tokens.values():
            counts[seq[2]] += 1
    assert eng.core.spec.num_drafts > num // 2 and eng.core.spec.num_accepted_tokens > 0
    expected = exact * num
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    stat = float(((observed - wanted) ** 2 / np.maximum(wanted, 1e-9)).sum())
    assert stat < chi_square_critical(int(big.sum())), stat


# ---- the draft-model proposer ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Another random model over the tiny one's vocabulary: its guesses mostly fail."""
    loaded: LoadedModel = load_tiny(tmp_path_factory.mktemp("draft") / "draft.gguf", seed=6)
    return loaded


def draft_engine(target: LoadedModel, draft: LoadedModel | None, *, num_blocks: int = 512, block_size: int = 4,
                 **kwargs: object) -> LLMEngine:
    """speculative="draft" with `draft` as the draft model (None: kwargs name draft_layers)."""
    return engine(target, "draft", num_blocks=num_blocks, block_size=block_size, draft=draft, **kwargs)


def tiny_requests(greedy_only: bool = False) -> list[tuple[str | list[int], SamplingParams]]:
    prompts: list[str | list[int]] = [[*range(3, 20)], [5, 9, 2, 40, 33, 7], [*range(60, 40, -1)], [11, 12] * 5]
    requests = [(p, SamplingParams(max_tokens=30, temperature=0.0, logprobs=0, ignore_eos=True)) for p in prompts]
    if not greedy_only:
        requests += [(prompts[0], SamplingParams(max_tokens=25, temperature=0.9, seed=7, ignore_eos=True)),
                     (prompts[2], SamplingParams(max_tokens=21, temperature=0.7, top_p=0.9, seed=8, ignore_eos=True))]
    return requests


@pytest.mark.parametrize("guesser", ["another model", "the model itself"])
def test_a_draft_models_guesses_change_no_output(tiny: LoadedModel, tiny_draft: LoadedModel, guesser: str) -> None:
    """Greedy, logprobs and seeded sampling as the plain engine gives them, with late arrivals whose
    prompts run beside drafting rows (the separate draft computes them too)."""
    draft = tiny_draft if guesser == "another model" else tiny
    requests = tiny_requests()
    plain = run(engine(tiny, "off", num_blocks=512, block_size=4), requests, late=2)
    eng = draft_engine(tiny, draft)
    spec = run(eng, requests, late=2)
    assert eng.core.spec.num_drafts > 10
    for rid, (tokens, reason, lps) in plain.items():
        assert spec[rid][0] == tokens and spec[rid][1] == reason, rid
        np.testing.assert_allclose(spec[rid][2], lps, atol=1e-4)
    assert eng.allocator.free_blocks() == eng.allocator.total_blocks()
    assert eng.runner.num_tracked() == 0 and eng.runner.drafter is not None and not eng.runner.drafter.missed()


def compare_caches_after_each_step(eng: LLMEngine) -> list[int]:
    """With the model as its own draft, the draft's K/V must equal the target's at every position of
    every sequence in a step, up to the step's own tokens: wraps eng.runner.execute to check so after
    each step; returns a list that counts the positions checked."""
    runner, checked = eng.runner, [0]
    drafter, execute = runner.drafter, runner.execute
    assert drafter is not None
    num_layers, bs = runner.kv.k.shape[0], runner.kv.block_size

    def execute_and_compare(step: StepBatch) -> StepOutput:
        out = execute(step)
        for c in step.chunks:
            positions = np.arange(c.start + len(c.token_ids) - c.num_draft)
            slots = np.asarray(c.block_ids)[positions // bs] * bs + positions % bs
            for target, draft in ((runner.kv.k, drafter.kv.k), (runner.kv.v, drafter.kv.v)):
                np.testing.assert_allclose(draft.reshape(num_layers, -1, *draft.shape[3:])[:, slots],
                                           target.reshape(num_layers, -1, *target.shape[3:])[:, slots], atol=1e-4)
            checked[0] += len(positions)
        return out

    runner.execute = execute_and_compare  # type: ignore[method-assign]
    return checked


def test_the_draft_keeps_its_cache_in_step(tiny: LoadedModel) -> None:
    """The model as its own draft: its K/V equal the target's at every position of every running
    sequence after every step (after prompt chunks, after runs kept whole, whose last guess the draft
    never ran, and after preemption: a tight cache), and every greedy guess is kept."""
    requests = tiny_requests(greedy_only=True)
    every = draft_engine(tiny, tiny, draft_p_min=0.0)         # guesses all it is asked for
    compare_caches_after_each_step(every)
    out = run(every, requests, late=2)
    assert every.core.spec.num_accepted_tokens == every.core.spec.num_draft_tokens
    roomy = draft_engine(tiny, tiny)                         # stops at a guess it gives under 0.75
    checked = compare_caches_after_each_step(roomy)
    assert {rid: v[:2] for rid, v in run(roomy, requests, late=2).items()} == {rid: v[:2] for rid, v in out.items()}
    assert checked[0] > 500
    assert 0 < roomy.core.spec.num_draft_tokens < every.core.spec.num_draft_tokens
    stats = roomy.core.spec
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
    tight = draft_engine(tiny, tiny, num_blocks=24, max_num_batched_tokens=16)
    compare_caches_after_each_step(tight)
    assert {rid: v[:2] for rid, v in run(tight, requests).items()} == {rid: v[:2] for rid, v in out.items()}
    assert tight.core.stats().num_preemptions > 0
    assert tight.core.spec.num_accepted_tokens == tight.core.spec.num_draft_tokens > 50
    assert tight.allocator.free_blocks() == tight.allocator.total_blocks()


def test_a_draft_of_the_models_first_layers(real: LoadedModel) -> None:
    """--draft-layers on the real model: the output is the plain engine's; the guesses of its first
    layers rarely land, and sequences whose guesses fail pause."""
    requests = [(chat(real, t), SamplingParams(max_tokens=32, temperature=0.0, logprobs=0)) for t in TASKS]
    plain = run(engine(real, "off"), requests, late=1)
    eng = draft_engine(real, None, num_blocks=1024, block_size=16, draft_layers=6)
    spec = run(eng, requests, late=1)
    assert {rid: v[:2] for rid, v in spec.items()} == {rid: v[:2] for rid, v in plain.items()}
    assert eng.core.spec.num_drafts > 0
    assert eng.allocator.free_blocks() == eng.allocator.total_blocks()


def test_the_real_model_as_its_own_draft(real: LoadedModel) -> None:
    """A separate draft model (here the model itself): greedy guesses land, seeded sampling keeps
    its seed's tokens, aborts mid-speculation leave nothing behind."""
    requests = [(chat(real, t), SamplingParams(max_tokens=24, temperature=0.0)) for t in TASKS[:3]]
    requests.append((chat(real, TASKS[3]), SamplingParams(max_tokens=24, temperature=0.8, seed=11)))
    plain = run(engine(real, "off"), requests)
    eng = draft_engine(real, real, num_blocks=512, block_size=16)
    spec = run(eng, requests)
    assert {rid: v[:2] for rid, v in spec.items() if rid != "r3"} == {rid: v[:2] for rid, v in plain.items()
                                                                      if rid != "r3"}
    assert spec["r3"][0] == run(draft_engine(real, real, num_blocks=512, block_size=16), requests)["r3"][0]
    stats = eng.core.spec
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens > 0
    run(eng, requests, abort_after={"r0": 3, "r1": 6})
    assert eng.allocator.free_blocks() == eng.allocator.total_blocks()
    assert eng.runner.num_tracked() == 0 and eng.runner.drafter is not None and not eng.runner.drafter.missed()


def test_a_draft_shares_the_cache_budget_and_bounds_the_context(tmp_path: Path, tiny: LoadedModel) -> None:
    """A separate draft keeps its K/V in the same blocks: a block costs both models' bytes, and the
    draft's shorter context bounds the sequences (the target's is 256 here, the draft's 128)."""
    from forge.engine.cache_plan import plan_cache
    from tests.tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "long.gguf", vocab=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=48,
                            seed=9, context=256)
    target = LoadedModel(str(path), LlamaModel.load(path), tiny.tokenizer, tiny.chat_template)
    both = KVCache.bytes_per_block(target.model.config, 4) + KVCache.bytes_per_block(tiny.model.config, 4)
    config = EngineConfig(kv_cache_dtype="float32",
                          block_size=4, kv_cache_memory=100 * both, speculative="draft", draft_model=tiny.path)
    plan = plan_cache(target.model, config, tiny.model)
    assert (plan.num_blocks, plan.max_model_len) == (100, 128)
    alone = plan_cache(target.model, EngineConfig(kv_cache_dtype="float32", block_size=4, kv_cache_memory=100 * both))
    assert (alone.num_blocks, alone.max_model_len) == (100 * both // KVCache.bytes_per_block(target.model.config, 4),
                                                        256)
    eng = LLMEngine(target, config, tiny)
    assert eng.max_model_len == 128 and eng.allocator.total_blocks() == 100


def test_drafts_are_refused_unless_they_fit(real: LoadedModel, tiny: LoadedModel) -> None:
    with pytest.raises(ValueError, match="needs a draft"):
        EngineConfig(speculative="draft")
    with pytest.raises(ValueError, match="go with --speculative draft"):
        EngineConfig(speculative="ngram", draft_layers=4)
    with pytest.raises(ConfigError, match="does not share .* vocabulary: it has 64 tokens"):
        draft_engine(real, tiny, num_blocks=64, block_size=16)
    with pytest.raises(ConfigError, match=r"--draft-layers must be in \[1, 29\]"):
        draft_engine(real, None, num_blocks=64, block_size=16, draft_layers=30)
