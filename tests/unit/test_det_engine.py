"""The deterministic numerics end to end (--numerics deterministic): a long prompt's greedy tokens and
log-probabilities are bit-identical served alone, in prompt chunks of several sizes, among sixteen other
prompts, from the prefix cache, with and without speculative guesses, and in blocks of another size; every
model family's logits (soft-capping, sliding windows, attention sinks, mixtures of experts) are bit-identical
from one prefill and from a short prefill followed by decode steps; and an int8 K/V cache is refused at
startup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forge.config import EngineConfig
from forge.errors import ConfigError
from forge.kernels import choose_kernels
from forge.llm import LLMEngine, LoadedModel
from forge.models.llama import KVCache, LlamaModel
from tests import tiny_families
from tests.unit.test_block_linear import RUNNABLE
from tests.unit.test_families import _reference
from tests.unit.test_families import _run as run_steps
from tests.unit.test_llm import MIXED_TEXTS, Result, greedy, run


@pytest.fixture(scope="module")
def loaded(default_model_path: Path) -> LoadedModel:
    return LoadedModel.load(str(default_model_path), kernels="blocks", numerics="deterministic")


def engine(loaded: LoadedModel, block_size: int = 16, dtype: str = "float16", **kw: Any) -> LLMEngine:
    per = KVCache.bytes_per_block(loaded.model.config, block_size) * 2
    return LLMEngine(loaded, EngineConfig(kv_cache_dtype=dtype, block_size=block_size, max_model_len=512,
                                          kv_cache_memory=8192 // block_size * per, **kw))


def logprobs(r: Result) -> np.ndarray:
    return np.array([[v for _, v in t.top_logprobs] for t in r.logprobs], dtype=np.float32)


def assert_identical(got: Result, want: Result, what: str) -> None:
    assert got.token_ids == want.token_ids, what
    assert np.array_equal(logprobs(got).view(np.uint32), logprobs(want).view(np.uint32)), what


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_prompts_bits_do_not_depend_on_how_it_is_served(loaded: LoadedModel, dtype: str) -> None:
    others = [loaded.tokenizer.encode(t) for t in MIXED_TEXTS][:16]
    long = loaded.tokenizer.encode(" ".join(MIXED_TEXTS) * 2)[:300]
    params = greedy(12, ignore_eos=True, logprobs=3)
    alone = run(engine(loaded, dtype=dtype, enable_prefix_caching=False, speculative="off"), {"a": (long, params)})["a"]
    assert len(alone.token_ids) == 12
    for budget in (7, 50, 128):
        got = run(engine(loaded, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=budget),
                  {"a": (long, params)})["a"]
        assert_identical(got, alone, f"chunks of {budget}")
    among = run(engine(loaded, dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=4096),
                {**{f"r{i}": (x, params) for i, x in enumerate(others)}, "a": (long, params)})["a"]
    assert_identical(among, alone, f"among {len(others)} others")
    cached = engine(loaded, dtype=dtype, enable_prefix_caching=True)
    run(cached, {"first": (long[:200], params)})
    hits = cached.allocator.num_prefix_hits
    assert_identical(run(cached, {"a": (long, params)})["a"], alone, "from the prefix cache")
    assert cached.allocator.num_prefix_hits - hits >= 192             # the first 200 tokens' whole blocks
    in_fours = run(engine(loaded, block_size=4, dtype=dtype, enable_prefix_caching=False), {"a": (long, params)})
    assert_identical(in_fours["a"], alone, "in blocks of 4")


def test_an_int8_cache_is_refused(loaded: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="int8"):
        engine(loaded, dtype="int8")


FAMILIES = sorted(tiny_families.SPECS)     # qwen2moe's shared-expert gate too (det_forward's dense product)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_gives_the_same_bits_by_prefill_and_by_decode(tmp_path: Path, name: str) -> None:
    """The tiny checkpoints of tests/unit/test_families.py in the deterministic numerics: the 20-token input's
    logits from one prefill and from 3 tokens then one per step are the same bits (gemma2's soft-capping and
    window, gpt-oss's sinks and window included), and stay near transformers' float32 logits."""
    model = LlamaModel.load(tiny_families.write_gguf(name, tmp_path / "tiny.gguf"),
                            choose_kernels("blocks", "deterministic"))
    assert model.weights.det
    ids, expected = _reference(name)
    whole, stepwise = run_steps(model, ids, len(ids)), run_steps(model, ids, 3)
    assert np.array_equal(whole.view(np.uint32), stepwise.view(np.uint32))
    np.testing.assert_allclose(whole, expected, atol=2e-2 * max(1.0, float(np.abs(expected).max()) / 10), rtol=0)


ENGINE_RUN = ("import sys, numpy as np; from forge.config import EngineConfig;"
              "from forge.llm import LLMEngine, LoadedModel;"
              "from forge.models.llama import KVCache; from tests.unit.test_llm import run, greedy, MIXED_TEXTS;"
              "from forge.kernels import compiled;"
              "loaded = LoadedModel.load(sys.argv[1], kernels='blocks', numerics='deterministic');"
              "assert compiled.status().startswith('compiled'), compiled.status();"
              "per = KVCache.bytes_per_block(loaded.model.config, 16) * 2;"
              "cfg = EngineConfig(kv_cache_dtype='float16', block_size=16, kv_cache_memory=256 * per * 2,"
              " max_model_len=512, max_num_batched_tokens=64);"
              "ids = loaded.tokenizer.encode(' '.join(MIXED_TEXTS) * 2)[:300];"
              "r = run(LLMEngine(loaded, cfg), {'a': (ids, greedy(12, ignore_eos=True, logprobs=3))})['a'];"
              "np.save(sys.argv[2], np.array([[v for _, v in t.top_logprobs] for t in r.logprobs]));"
              "np.save(sys.argv[3], np.array(r.token_ids))")


def test_a_long_prompt_is_the_same_on_every_level(default_model_path: Path, tmp_path: Path) -> None:
    """The whole request, in a process per build level (FORGE_KERNEL_ISA): a 300-token prompt in chunks of 64, its 12
    greedy tokens' top-3 logprobs, bit for bit the same under native, avx512, avx2 and the scalar baseline."""
    root = Path(__file__).resolve().parents[2]
    got = {}
    for isa in RUNNABLE:
        lp, ids = tmp_path / f"{isa}-lp.npy", tmp_path / f"{isa}-ids.npy"
        done = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(default_model_path), str(lp), str(ids)],
                              capture_output=True, text=True, timeout=600, cwd=root,
                              env={**os.environ, "FORGE_KERNEL_ISA": isa, "PYTHONPATH": str(root)})
        assert done.returncode == 0, done.stderr[-2000:]
        got[isa] = (np.load(lp), np.load(ids))
    assert len(got) >= 2 and got["native"][0].shape == (12, 3)
    for isa, (lp_isa, ids_isa) in got.items():
        assert np.array_equal(ids_isa, got["native"][1]), isa
        assert np.array_equal(lp_isa.view(np.uint64), got["native"][0].view(np.uint64)), isa
