"""Embedding requests in the engine: a prompt-only sequence that returns its pooled final hidden
state. The pooling modes against a float64 numpy reference of the default model's normed hidden
states; chunked prefill, the prefix cache and a mixed batch give the same vectors; nothing is kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from forge.config import EngineConfig
from forge.engine.pooling import PoolState, l2_normalised
from forge.errors import InvalidRequest, PromptTooLong
from forge.llm import LLMEngine, LoadedModel
from forge.sampling.sampling_params import SamplingParams
from tests.unit.test_llama import reference_hidden

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Embeddings: café, naïve, 東京, 🙂",
         "a", "Paris is the capital of France, and Berlin is the capital of Germany; both are large cities."]
COSINE = 0.9999


@pytest.fixture(scope="module")
def loaded(default_model_path: Path) -> LoadedModel:
    return LoadedModel.load(default_model_path, progress=lambda message: None)


def embed_all(engine: LLMEngine, prompts: dict[str, list[int]], pooling: str,
              generate: dict[str, list[int]] | None = None) -> tuple[dict[str, np.ndarray], dict[str, list[int]]]:
    """Submit every request at once, run the engine until idle; the vectors, and generated tokens."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, pooling=pooling))
    for rid, ids in (generate or {}).items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=12, temperature=0.0))
    vectors: dict[str, np.ndarray] = {}
    tokens: dict[str, list[int]] = {rid: [] for rid in generate or {}}
    while engine.has_work():
        for ev in engine.step():
            if ev.embedding is not None:
                assert ev.finish_reason == "stop" and not ev.token_ids
                assert ev.counts.prompt == len(prompts[ev.request_id])
                vectors[ev.request_id] = np.frombuffer(ev.embedding, dtype="<f4")
            else:
                tokens[ev.request_id].extend(ev.token_ids)
    assert set(vectors) == set(prompts)
    return vectors, tokens


def assert_idle_and_empty(engine: LLMEngine) -> None:
    assert not engine.has_work()
    assert engine.allocator.free_blocks() == engine.allocator.total_blocks()
    assert not engine.allocator.sequences()
    assert engine.runner.num_tracked() == 0
    assert not any(engine.core.tracked().values())


def reference_vector(path: Path, ids: list[int], pooling: str) -> np.ndarray:
    hidden, _ = reference_hidden(path, ids)                                  # [n, H] float64
    pooled = {"mean": hidden.mean(axis=0), "last": hidden[-1], "cls": hidden[0]}[pooling]
    return pooled / np.linalg.norm(pooled)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_vectors_match_the_float64_reference(loaded: LoadedModel, default_model_path: Path,
                                                    pooling: str) -> None:
    engine = LLMEngine(loaded, EngineConfig(max_num_batched_tokens=64))
    prompts = {f"e{i}": loaded.tokenizer.encode(t) for i, t in enumerate(TEXTS[:3])}
    vectors, _ = embed_all(engine, prompts, pooling)
    for rid, ids in prompts.items():
        got = vectors[rid]
        assert got.shape == (loaded.model.config.hidden_size,)
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
        assert float(got @ reference_vector(default_model_path, ids, pooling)) > COSINE, rid
    assert_idle_and_empty(engine)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunked_prefill_and_a_mixed_batch_give_the_same_vectors(loaded: LoadedModel, pooling: str) -> None:
    prompts = {f"e{i}": loaded.tokenizer.encode(t) for i, t in enumerate(TEXTS)}
    whole, _ = embed_all(LLMEngine(loaded, EngineConfig(max_num_batched_tokens=512)), prompts, pooling)
    chat = {"g": loaded.tokenizer.encode("The capital of France is")}
    alone = LLMEngine(loaded, EngineConfig(max_num_batched_tokens=512))
    _, greedy_alone = embed_all(alone, {}, pooling, chat)
    chunked = LLMEngine(loaded, EngineConfig(max_num_batched_tokens=7))   # every prompt runs in chunks
    pieces, greedy_mixed = embed_all(chunked, prompts, pooling, chat)
    for rid in prompts:
        assert float(whole[rid] @ pieces[rid]) > 0.99999, rid
    assert greedy_mixed == greedy_alone                                     # the chat is untouched
    assert_idle_and_empty(chunked)


def test_last_pooling_may_be_served_by_the_prefix_cache(loaded: LoadedModel) -> None:
    engine = LLMEngine(loaded, EngineConfig())
    ids = loaded.tokenizer.encode(TEXTS[3] * 2)
    first, _ = embed_all(engine, {"a": ids}, "last")
    engine.add_request("b", ids, SamplingParams(max_tokens=1, pooling="last"))
    second = None
    while engine.has_work():
        for ev in engine.step():
            assert ev.counts.cached >= 16                                   # its prefix came from the cache
            second = np.frombuffer(ev.embedding or b"", dtype="<f4")
    assert second is not None and float(first["a"] @ second) > 0.99999
    assert_idle_and_empty(engine)


def test_mean_pooling_computes_every_token_despite_the_cache(loaded: LoadedModel) -> None:
    engine = LLMEngine(loaded, EngineConfig())
    ids = loaded.tokenizer.encode(TEXTS[3] * 2)
    first, _ = embed_all(engine, {"a": ids}, "mean")
    engine.add_request("b", ids, SamplingParams(max_tokens=1, pooling="mean"))
    while engine.has_work():
        for ev in engine.step():
            assert ev.counts.cached == 0
            assert float(first["a"] @ np.frombuffer(ev.embedding or b"", dtype="<f4")) > 0.99999


def test_an_input_longer_than_the_context_is_refused_naming_input(loaded: LoadedModel) -> None:
    engine = LLMEngine(loaded, EngineConfig(max_model_len=32))
    with pytest.raises(PromptTooLong) as info:
        engine.add_request("x", [1] * 33, SamplingParams(max_tokens=1, pooling="last"))
    assert info.value.param == "input"
    vectors, _ = embed_all(engine, {"y": [1] * 32}, "last")                 # the whole context fits
    assert vectors["y"].shape == (loaded.model.config.hidden_size,)
    with pytest.raises(InvalidRequest) as bad:
        engine.add_request("z", [1], SamplingParams(max_tokens=1, pooling="max"))
    assert bad.value.param == "pooling"
    assert_idle_and_empty(engine)


def test_a_preempted_mean_pooling_starts_over() -> None:
    from forge.messages import SeqChunk
    state = PoolState("mean")
    rows = np.arange(12, dtype=np.float32).reshape(4, 3)

    def chunk(start: int, n: int, samples: bool) -> SeqChunk:
        return SeqChunk(seq_id=0, token_ids=(1,) * n, start=start, block_ids=(0,), samples=samples,
                        num_output_tokens=0)

    assert state.add(chunk(0, 2, False), rows[:2]) is None
    assert state.add(chunk(0, 2, False), rows[:2]) is None                 # recomputed from the start
    got = state.add(chunk(2, 2, True), rows[2:])
    assert got is not None
    np.testing.assert_allclose(got, l2_normalised(rows.mean(axis=0)), rtol=1e-6)
