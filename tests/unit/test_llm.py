"""Engine-level correctness of forge.llm: LLMEngine and LLM over the paged cache, end to end.

A tiny random GGUF checks paged decode against a full recompute; the real default model (which
must be installed: see tests/conftest.py) checks batch independence under chunked prefill, preemption and prefix
caching, seeded sampling, stop rules, logprobs, request errors and abort.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import pytest

from forge.config import EngineConfig
from forge.errors import ConfigError, InvalidRequest, PromptTooLong
from forge.llm import LLM, LLMEngine, LoadedModel
from forge.messages import SampledToken
from forge.models.llama import KVCache, LlamaModel
from forge.sampling.sampling_params import SamplingParams
from tests.tiny_gguf import load_tiny

TIE_GAP = 1e-3          # a top-2 logit gap below this is a near-tie: float noise may flip the argmax
LOGPROB_TOL = 1e-3

Reference = dict[str, tuple[list[int], list[np.ndarray]]]   # prompt id -> (greedy ids, logprobs per step)


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)  # type: ignore[arg-type]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)                                            # [V]
    peak = x.max()
    return x - peak - np.log(np.exp(x - peak).sum())                         # [V]


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None

    def top2_gaps(self) -> list[float]:
        return [t.top_logprobs[0][1] - t.top_logprobs[1][1] for t in self.logprobs]


def run(engine: LLMEngine, requests: Mapping[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """Submit every request at once, step until the engine is idle, collect each request's events."""
    results = {rid: Result() for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_work():
        for ev in engine.step():
            out = results[ev.request_id]
            assert out.finish_reason is None, "an event after the request finished"
            out.token_ids.extend(ev.token_ids)
            out.logprobs.extend(ev.logprobs)
            out.finish_reason = ev.finish_reason
    return results


def assert_same_greedy(reference: Result, other: Result, what: str) -> None:
    """Equal tokens up to the reference's first near-tie (where float noise may pick either)."""
    gaps = reference.top2_gaps()
    cut = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(reference.token_ids))
    assert other.token_ids[:cut] == reference.token_ids[:cut], what
    assert len(other.token_ids) == len(reference.token_ids), what


def assert_idle_and_empty(engine: LLMEngine) -> None:
    assert not engine.has_work()
    assert engine.allocator.free_blocks() == engine.allocator.total_blocks()
    assert engine.runner.num_tracked() == 0


# ---- the tiny random model: paged decode against a full recompute ---------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A random 2-layer model (F32) with a hand-built tokenizer (tests/tiny_gguf.py)."""
    loaded: LoadedModel = load_tiny(tmp_path_factory.mktemp("tiny") / "tiny.gguf", seed=11)
    return loaded


def tiny_engine(loaded: LoadedModel, *, block_size: int = 4, num_blocks: int = 64, max_model_len: int = 64,
                **kwargs: object) -> LLMEngine:
    per_block = KVCache.bytes_per_block(loaded.model.config, block_size)
    config = EngineConfig(kv_cache_dtype="float32",
                          block_size=block_size, kv_cache_memory=num_blocks * per_block, max_model_len=max_model_len,
                          **kwargs)  # type: ignore[arg-type]
    return LLMEngine(loaded, config)


TINY_PROMPTS = {
    "a": [5, 17, 3, 42, 8, 8, 29, 60, 1, 33, 12],
    "b": [7],
    "c": [5, 17, 3, 42, 8, 8, 29, 60, 9, 9, 50, 4, 4, 20, 31],   # shares two blocks with "a"
    "d": [40, 41, 42, 43, 44, 45],
    "e": [5, 17, 3, 42, 8, 8, 29, 60, 1, 33, 12],                 # the same as "a"
}


def recompute_greedy(model: LlamaModel, prompt: list[int], num_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens from a full forward over the whole context at every step (no paged cache)."""
    context, out, logprobs = list(prompt), [], []
    for _ in range(num_tokens):
        lp = log_softmax(model.forward_context(context))                     # [V]
        token = int(np.argmax(lp))
        out.append(token)
        logprobs.append(lp)
        context.append(token)
    return out, logprobs


@pytest.fixture(scope="module")
def tiny_reference(tiny: LoadedModel) -> dict[str, tuple[list[int], list[np.ndarray]]]:
    return {rid: recompute_greedy(tiny.model, ids, 20) for rid, ids in TINY_PROMPTS.items()}


@pytest.mark.parametrize("budget", [512, 5, 1])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [64, 12])
def test_paged_decode_equals_full_recompute(tiny: LoadedModel, tiny_reference: Reference,
                                            budget: int, prefix_caching: bool, num_blocks: int) -> None:
    engine = tiny_engine(tiny, num_blocks=num_blocks, max_model_len=min(64, 4 * num_blocks),
                         max_num_batched_tokens=budget,
                         enable_prefix_caching=prefix_caching)
    params = greedy(20, ignore_eos=True, logprobs=2)
    results = run(engine, {rid: (ids, params) for rid, ids in TINY_PROMPTS.items()})
    for rid, (expected, ref_logprobs) in tiny_reference.items():
        got = results[rid]
        assert got.token_ids == expected, rid
        assert got.finish_reason == "length"
        for tok, ref in zip(got.logprobs, ref_logprobs, strict=True):
            assert tok.logprob == pytest.approx(ref[tok.token_id], abs=1e-4)
    if num_blocks == 12 and budget > 1:    # 5 sequences of up to 35 tokens in 12 blocks of 4 cannot
                                           # all stay (a budget of 1 runs them one after the other)
        assert engine.core.stats().num_preemptions > 0
    assert_idle_and_empty(engine)


def test_tiny_prefix_cache_hits_reuse_blocks(tiny: LoadedModel, tiny_reference: Reference) -> None:
    engine = tiny_engine(tiny, enable_prefix_caching=True)
    params = greedy(20, ignore_eos=True)
    first = run(engine, {"a": (TINY_PROMPTS["a"], params)})
    second = run(engine, {"c": (TINY_PROMPTS["c"], params), "a2": (TINY_PROMPTS["a"], params)})
    assert engine.core.num_cached_tokens("a2") == 0          # finished: the core forgot it
    assert first["a"].token_ids == second["a2"].token_ids == tiny_reference["a"][0]
    assert second["c"].token_ids == tiny_reference["c"][0]
    assert engine.allocator.num_prefix_hits > 0
    assert_idle_and_empty(engine)


# ---- request errors and abort (tiny model) --------------------------------------------------

def test_prompt_longer_than_max_model_len_raises(tiny: LoadedModel) -> None:
    engine = tiny_engine(tiny)
    assert engine.max_model_len == 64
    with pytest.raises(PromptTooLong):
        engine.add_request("long", [5] * 64, greedy(4))     # no room left for one new token
    with pytest.raises(PromptTooLong):
        engine.add_request("longer", [5] * 200, greedy(4))
    engine.add_request("fits", [5] * 63, greedy(4))
    assert engine.has_work()


def test_empty_prompt_raises(tiny: LoadedModel) -> None:
    engine = tiny_engine(tiny)
    with pytest.raises(InvalidRequest):
        engine.add_request("empty-ids", [], greedy(4))
    with pytest.raises(InvalidRequest):
        engine.add_request("empty-text", "", greedy(4))
    assert not engine.has_work()


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_steps", [1, 3, 8])
def test_abort_frees_every_block(tiny: LoadedModel, prefix_caching: bool, num_steps: int) -> None:
    engine = tiny_engine(tiny, max_num_batched_tokens=6, enable_prefix_caching=prefix_caching)
    for rid, ids in TINY_PROMPTS.items():
        engine.add_request(rid, ids, greedy(30, ignore_eos=True))
    for _ in range(num_steps):                 # some mid-prefill (budget 6), some decoding
        engine.step()
    assert engine.allocator.free_blocks() < engine.allocator.total_blocks()
    for rid in TINY_PROMPTS:
        assert engine.abort(rid)
    assert not engine.abort("a")               # already gone
    events = engine.step()                     # the step after the abort gives the blocks back
    assert events == []
    assert_idle_and_empty(engine)


def test_abort_one_leaves_the_others_intact(tiny: LoadedModel, tiny_reference: Reference) -> None:
    engine = tiny_engine(tiny, max_num_batched_tokens=8)
    for rid, ids in TINY_PROMPTS.items():
        engine.add_request(rid, ids, greedy(20, ignore_eos=True))
    results = {rid: Result() for rid in TINY_PROMPTS}
    for step in range(40):
        if step == 4:
            engine.abort("c")
        for ev in engine.step():
            results[ev.request_id].token_ids.extend(ev.token_ids)
            results[ev.request_id].finish_reason = ev.finish_reason
    assert results["c"].finish_reason is None
    for rid in ("a", "b", "d", "e"):
        assert results[rid].token_ids == tiny_reference[rid][0]
    assert_idle_and_empty(engine)


# ---- the real model --------------------------------------------------------------------------

def real_engine(loaded: LoadedModel, *, block_size: int = 4, num_blocks: int | None = None,
                **kwargs: object) -> LLMEngine:
    """An engine with max_model_len 128; num_blocks None gives plenty."""
    per_block = KVCache.bytes_per_block(loaded.model.config, block_size)
    num_blocks = num_blocks if num_blocks is not None else 2048 // block_size
    config = EngineConfig(kv_cache_dtype="float32",
                          block_size=block_size, kv_cache_memory=num_blocks * per_block, max_model_len=128,
                          **kwargs)  # type: ignore[arg-type]
    return LLMEngine(loaded, config)


MIXED_TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at",
    "Shopping list:\n1. apples\n2.",
    "The capital of France is",                               # a duplicate
    "The capital of France is a city where",                  # shares a prefix
    "SELECT name FROM users WHERE",
    "Hi",
    "La capitale de l'Allemagne est",
    "Once upon a time, in a small village by the sea, there lived",
    "2 + 2 = 4\n3 + 5 =",
    "import numpy as np\n",
    "In 1969, Neil Armstrong",
    "Steps to make tea:\n-",
]
ALONE = (0, 1, 2, 9, 13)               # indices run one at a time as the reference
NUM_NEW = 12


@pytest.fixture(scope="module")
def mixed_ids(real: LoadedModel) -> list[list[int]]:
    return [real.tokenizer.encode(text) for text in MIXED_TEXTS]


@pytest.fixture(scope="module")
def alone(real: LoadedModel, mixed_ids: list[list[int]]) -> dict[int, Result]:
    out = {}
    for i in ALONE:
        engine = real_engine(real)
        out[i] = run(engine, {"alone": (mixed_ids[i], greedy(NUM_NEW, ignore_eos=True, logprobs=2))})["alone"]
    return out


@pytest.fixture(scope="module")
def batched_reference(real: LoadedModel, mixed_ids: list[list[int]]) -> dict[str, Result]:
    """All 16 together with a large budget and prefix caching off: what the other layouts must match."""
    engine = real_engine(real, max_num_batched_tokens=4096, enable_prefix_caching=False)
    params = greedy(NUM_NEW, ignore_eos=True, logprobs=2)
    return run(engine, {f"r{i}": (ids, params) for i, ids in enumerate(mixed_ids)})


def test_batch_of_16_matches_each_prompt_alone(alone: dict[int, Result], batched_reference: dict[str, Result]) -> None:
    for i, result in alone.items():
        assert result.finish_reason == "length"
        assert_same_greedy(result, batched_reference[f"r{i}"], MIXED_TEXTS[i])
    assert batched_reference["r0"].token_ids == batched_reference["r6"].token_ids   # the duplicate prompt


LAYOUTS = {
    "large-budget": dict(max_num_batched_tokens=4096),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(max_num_batched_tokens=4096, num_blocks=56),   # 16 x ~6 blocks wanted, 56 held
}


# (large-budget without prefix caching is the batched reference itself)
@pytest.mark.parametrize(("layout", "prefix_caching"),
                         [(layout, on) for layout in LAYOUTS for on in (True, False)
                          if (layout, on) != ("large-budget", False)])
def test_batch_layout_does_not_change_greedy_tokens(real: LoadedModel, mixed_ids: list[list[int]],
                                                    alone: dict[int, Result], batched_reference: dict[str, Result],
                                                    layout: str, prefix_caching: bool) -> None:
    engine = real_engine(real, enable_prefix_caching=prefix_caching, **LAYOUTS[layout])  # type: ignore[arg-type]
    params = greedy(NUM_NEW, ignore_eos=True, logprobs=2)
    results = run(engine, {f"r{i}": (ids, params) for i, ids in enumerate(mixed_ids)})
    for i in range(len(mixed_ids)):
        reference = alone.get(i, batched_reference[f"r{i}"])
        assert_same_greedy(reference, results[f"r{i}"], f"{layout}: {MIXED_TEXTS[i]!r}")
        assert results[f"r{i}"].finish_reason == "length"
    if layout == "preemption":
        assert engine.core.stats().num_preemptions > 0
    if prefix_caching and layout == "chunked-prefill":     # admitted over several steps: the shared
        assert engine.allocator.num_prefix_hits > 0                # prefixes are found in the cache
    assert_idle_and_empty(engine)


def test_seeded_sampling_is_batch_independent(real: LoadedModel, mixed_ids: list[list[int]]) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    prompt = mixed_ids[1]
    alone = run(real_engine(real), {"s": (prompt, seeded)})["s"]
    batched = run(real_engine(real), {
        "o-seeded": (mixed_ids[0], SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)),
        "o-unseeded": (mixed_ids[2], SamplingParams(max_tokens=9, temperature=0.9, ignore_eos=True)),
        "o-topp": (mixed_ids[3], SamplingParams(max_tokens=12, temperature=1.2, top_p=0.9, top_k=40)),
        "o-greedy": (mixed_ids[4], greedy(5)),
        "s": (prompt, seeded),
        "s-again": (prompt, seeded),
        "s-seed-8": (prompt, SamplingParams(max_tokens=12, temperature=0.8, seed=8, ignore_eos=True)),
    })
    assert batched["s"].token_ids == alone.token_ids
    assert batched["s-again"].token_ids == alone.token_ids
    assert batched["s-seed-8"].token_ids != alone.token_ids    # the seed matters (12 draws at T=0.8)


@pytest.fixture
def llm(real: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[LLM]:
    """An LLM around the module's loaded model (LLM() would load the file again)."""
    monkeypatch.setattr(LoadedModel, "load", classmethod(lambda cls, path=None, *, kernels="auto", numerics="reference",
                                                            progress=None: real))
    yield LLM(None, EngineConfig(kv_cache_dtype="float32", block_size=4, kv_cache_memory=64 * 2**20, max_model_len=256))


def test_stop_string_ends_with_stop_and_is_not_in_text(llm: LLM) -> None:
    prompt = "Once upon a time, in a small village by the sea,"
    full = llm.generate([prompt], greedy(16, ignore_eos=True))[0]
    assert full.finish_reason == "length"
    assert len(full.token_ids) == 16
    words = full.text.split()
    stop = " " + words[len(words) // 2]                      # a word from the middle, with its space
    assert stop in full.text
    stopped = llm.generate([prompt], greedy(16, ignore_eos=True, stop=(stop, "never-appears")))[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert stopped.text == full.text[: full.text.index(stop)]
    assert len(stopped.token_ids) < 16
    streamed = list(llm.stream(prompt, greedy(16, ignore_eos=True, stop=(stop,))))
    assert "".join(streamed) == stopped.text
    assert not llm.engine.has_work()
    assert llm.engine.allocator.free_blocks() == llm.engine.allocator.total_blocks()


def test_max_tokens_gives_length(llm: LLM) -> None:
    out = llm.generate(["Water boils at", "Hi"], greedy(5, ignore_eos=True))
    assert [c.finish_reason for c in out] == ["length", "length"]
    assert [len(c.token_ids) for c in out] == [5, 5]


def test_min_tokens_and_ignore_eos(llm: LLM) -> None:
    eos = llm.tokenizer.eos_token_id
    prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    natural = llm.generate([prompt], greedy(64))[0]
    assert natural.finish_reason == "stop"                  # the model ends its answer with eos
    assert natural.token_ids[-1] == eos
    num = len(natural.token_ids)

    held, ignored, by_id = llm.generate([prompt] * 3, [
        greedy(64, min_tokens=num + 3),
        greedy(num + 4, ignore_eos=True),
        greedy(64, stop_token_ids=(natural.token_ids[1],)),
    ])
    assert eos not in held.token_ids[: num + 3]             # eos was not allowed before min_tokens
    assert len(held.token_ids) >= num + 3
    assert held.token_ids[: num - 1] == natural.token_ids[: num - 1]

    assert ignored.finish_reason == "length"
    assert len(ignored.token_ids) == num + 4
    assert ignored.token_ids[:num] == natural.token_ids      # eos itself is emitted, then it goes on

    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == natural.token_ids[:2]


def test_logprobs_match_log_softmax_of_a_full_forward(llm: LLM) -> None:
    model = llm.loaded.model
    params = [greedy(6, logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=3, ignore_eos=True)]
    for out, p in zip(llm.generate(["The capital of France is"] * 2, params), params, strict=True):
        assert len(out.logprobs) == len(out.token_ids) == 6
        context = list(out.prompt_token_ids)
        for token, lp in zip(out.token_ids, out.logprobs, strict=True):
            ref = log_softmax(model.forward_context(context))                # [V]
            assert lp.token_id == token
            assert lp.logprob == pytest.approx(ref[token], abs=LOGPROB_TOL)
            assert len(lp.top_logprobs) == p.logprobs
            for top_id, top_lp in lp.top_logprobs:
                assert top_lp == pytest.approx(ref[top_id], abs=LOGPROB_TOL)
            values = [v for _, v in lp.top_logprobs]
            assert values == sorted(values, reverse=True)
            assert values[-1] >= np.sort(ref)[-len(values)] - LOGPROB_TOL  # no better token was left out
            if p.is_greedy:
                assert token == int(np.argmax(ref))
            context.append(token)


def test_every_end_token_ends_a_request(real: LoadedModel, mixed_ids: list[list[int]]) -> None:
    """<|endoftext|> ends a request as eos (<|im_end|>) does; ignore_eos lets both through."""
    engine = real_engine(real)
    endoftext = real.tokenizer.token_to_id("<|endoftext|>")
    assert endoftext is not None and endoftext != real.tokenizer.eos_token_id
    forced = ((endoftext, 100.0),)
    out = run(engine, {
        "ends": (mixed_ids[0], greedy(8, logit_bias=forced)),
        "ignores": (mixed_ids[0], greedy(3, logit_bias=forced, ignore_eos=True)),
    })
    assert (out["ends"].token_ids, out["ends"].finish_reason) == ([endoftext], "stop")
    assert (out["ignores"].token_ids, out["ignores"].finish_reason) == ([endoftext] * 3, "length")
    assert_idle_and_empty(engine)


# ---- the K/V budget --------------------------------------------------------------------------

def test_the_default_kv_budget_is_sized_to_the_model(tiny: LoadedModel) -> None:
    """Unset, the budget holds max_num_seqs sequences of TYPICAL_SEQ_TOKENS (or one whole context,
    if more) in the cache's dtype; int8 takes fewer bytes for the same tokens."""
    from forge.engine.cache_plan import TYPICAL_SEQ_TOKENS, plan_cache

    model = tiny.model
    context = model.config.max_position
    for seqs, dtype in ((8, "float16"), (1, "float16"), (8, "int8"), (8, "float32")):
        if dtype == "int8" and model.config.head_dim % 32:
            continue
        config = EngineConfig(block_size=4, max_num_seqs=seqs, kv_cache_dtype=dtype)
        plan = plan_cache(model, config, memory=64 * 2**30)
        tokens = max(seqs * TYPICAL_SEQ_TOKENS, context)
        per_token = KVCache.bytes_per_block(model.config, 1, dtype)
        assert (plan.sized, plan.warning) == ("model", None)
        assert plan.num_blocks * 4 == -(-tokens // 4) * 4 and plan.bytes_per_token == per_token
        assert plan.budget == plan.num_blocks * 4 * per_token and plan.max_model_len == context


def test_a_budget_capped_by_memory_says_why_the_context_shrank(tiny: LoadedModel) -> None:
    from forge.engine.cache_plan import KV_MEMORY_SHARE, plan_cache

    model = tiny.model
    per_block = KVCache.bytes_per_block(model.config, 4, "float16")
    memory = int(10 * per_block / KV_MEMORY_SHARE) + 1                 # room for 10 blocks: 40 tokens
    plan = plan_cache(model, EngineConfig(block_size=4), memory=memory)
    assert plan.num_blocks == 10 and plan.max_model_len == 40 < model.config.max_position
    assert plan.warning is not None and "--kv-cache-memory" in plan.warning and "int8" in plan.warning
    assert str(model.config.max_position) in plan.warning
    with pytest.raises(ConfigError, match="cannot hold one sequence"):       # a length that does not fit
        plan_cache(model, EngineConfig(block_size=4, max_model_len=100), memory=memory)
    set_plan = plan_cache(model, EngineConfig(block_size=4, kv_cache_memory=per_block * 1000), memory=memory)
    assert (set_plan.sized, set_plan.num_blocks, set_plan.warning) == ("set", 1000, None)   # a set budget stands


def test_the_machine_memory_is_read_here() -> None:
    from forge.engine.cache_plan import machine_memory

    memory = machine_memory()
    assert memory is not None and memory > 2**28


def test_a_1_7b_model_serves_32_streams_of_1024_tokens_in_24_gib_by_default() -> None:
    """SmolLM2-1.7B's shapes (24 layers, 32 KV heads of 64, a context of 8192): the default budget
    on a 24 GiB machine holds 32 sequences of 1,024 tokens at the whole context, in float16 and in
    int8 (float32 would not: 384 KiB a token)."""
    from types import SimpleNamespace

    from forge.engine.cache_plan import plan_cache

    model = SimpleNamespace(config=SimpleNamespace(num_layers=24, num_kv_heads=32, head_dim=64, max_position=8192))
    for dtype in ("float16", "int8"):
        plan = plan_cache(model, EngineConfig(kv_cache_dtype=dtype), memory=24 * 2**30)  # type: ignore[arg-type]
        assert plan.num_blocks * 16 >= 32 * 1024 and plan.max_model_len == 8192 and plan.warning is None
        assert plan.budget <= 0.4 * 24 * 2**30


def test_a_limit_past_the_room_is_clamped_once_and_every_reader_sees_it(tiny: LoadedModel) -> None:
    """max_tokens past what the context leaves is clamped where the sequence is made, and the params the
    runner gets say so: a JSON closing window (close_within) then opens within the room, at a quarter of it
    at most. The runner once read the request's own max_tokens, so a schema-constrained request without
    max_tokens near the context's end hit the end before its closing window opened."""
    engine = tiny_engine(tiny, max_model_len=64)
    seen: list[SamplingParams] = []
    engine.on_step = lambda batch, _seconds: seen.extend(s.params for s in batch.new_seqs)
    engine.add_request("near-the-end", list(range(1, 57)), greedy(10_000, close_within=32, ignore_eos=True))
    engine.add_request("with-room", [5, 6], greedy(6, close_within=2, ignore_eos=True))
    emitted: dict[str, int] = {}
    while engine.has_work():
        for out in engine.step():
            emitted[out.request_id] = emitted.get(out.request_id, 0) + len(out.token_ids)
    params = {p.max_tokens: p for p in seen}
    assert set(params) == {6, 64 - 56}                  # the room: 8 tokens, the one limit everywhere
    assert params[6].close_within == 2                  # a request within its room is left as it was
    assert params[64 - 56].close_within == (64 - 56) // 4
    assert emitted == {"near-the-end": 64 - 56, "with-room": 6}
