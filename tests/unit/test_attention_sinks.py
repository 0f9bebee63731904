"""Attention sinks (gpt-oss): a learned logit per query head that joins its softmax's denominator and
weighs no value, in every attention path forge has.

    out = sum_j exp(s_j - m) v_j / (sum_j exp(s_j - m) + exp(sink - m)),   m = max(max_j s_j, sink)

The numpy reference (forge.models.llama.attention: decode groups and prefill tiles) is checked against that
definition written out per row; the compiled decode kernel (paged_attention.c: every K/V storage type, head
by head and position by position, on the engine's pool and the compiled products', the AVX2 build) and
prefill kernel (prefill_attention.c's online softmax) against the numpy reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.config import KV_CACHE_DTYPES
from forge.kernels import compiled, prefill_kernel, products
from forge.models.forward_batch import ForwardBatch
from forge.models.llama.attention import attend
from forge.models.llama.attention_plan import plan_attention
from forge.models.llama.kv_dtype import storage_dtype, to_float32, to_storage
from tests.unit.test_kernels import paged_batch, stored_kv

pytestmark = pytest.mark.skipif(compiled.library() is None, reason="no compiled kernels here")


def by_definition(batch: ForwardBatch, q: np.ndarray, k: np.ndarray, v: np.ndarray, sinks: np.ndarray,
                  window: int) -> np.ndarray:
    """Each query row's attention written out: its visible keys gathered through its block table, the
    sink appended to its scores, softmax in float64, the sink's share dropped."""
    block_size = k.shape[1]
    group = q.shape[1] // k.shape[2]
    out = np.zeros(q.shape, np.float64)
    seq_of = np.repeat(np.arange(batch.num_seqs), np.diff(batch.query_start))
    for t, (s, p) in enumerate(zip(seq_of, batch.positions, strict=True)):
        keys = np.arange(max(0, p - window + 1) if window else 0, p + 1)
        slots = batch.block_tables[s, keys // block_size] * block_size + keys % block_size
        kk = k.reshape(-1, *k.shape[2:])[slots].astype(np.float64)                    # [n, nkv, hd]
        vv = v.reshape(-1, *v.shape[2:])[slots].astype(np.float64)
        for h in range(q.shape[1]):
            logits = np.append(kk[:, h // group] @ q[t, h].astype(np.float64), sinks[h])
            weights = np.exp(logits - logits.max())
            weights /= weights.sum()
            out[t, h] = weights[:-1] @ vv[:, h // group]
    return out


Case = tuple[ForwardBatch, SimpleNamespace, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None,
             np.ndarray, np.ndarray]


def case(seed: int, lens: list[int], query_lens: list[int], kv_heads: int, group: int, head_dim: int,
         block_size: int, kv_dtype: str = "float32") -> Case:
    """A step's batch, its config, the K/V cache as kv_dtype stores it (and its int8 scales), queries and
    one sink per query head."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    batch = paged_batch(rng, lens, query_lens, block_size, num_blocks)
    config = SimpleNamespace(num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, k_scales = stored_kv((rng.standard_normal(shape) * 2).astype(np.float32), kv_dtype)
    v, v_scales = stored_kv(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    scales = None if k_scales is None or v_scales is None else (k_scales, v_scales)
    q = (rng.standard_normal((batch.num_tokens, kv_heads * group, head_dim)) / 2).astype(np.float32)
    # sinks from far below the scores (no effect) to far above (most of the weight): every regime
    sinks = (rng.standard_normal(kv_heads * group) * 4).astype(np.float32)
    return batch, config, k, v, scales, q, sinks


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), prefill=st.booleans(),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), block_size=st.sampled_from([1, 4]),
       window=st.sampled_from([0, 1, 5]), seed=st.integers(0, 2**32 - 1))
def test_the_numpy_reference_is_the_definition(lens: list[int], prefill: bool, kv_heads: int, group: int,
                                               block_size: int, window: int, seed: int) -> None:
    """Decode rows and prompt chunks on the numpy path: each row's softmax over its keys and its head's sink."""
    query_lens = [n if prefill else 1 for n in lens]
    batch, config, k, v, _, q, sinks = case(seed, lens, query_lens, kv_heads, group, 16, block_size)
    got = attend(plan_attention(batch, config, block_size, 2, window=window), q, k, v, sinks=sinks)
    np.testing.assert_allclose(got, by_definition(batch, q, k, v, sinks, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("prefill", [False, True])
def test_a_sink_far_below_the_scores_is_none_and_far_above_takes_all_the_weight(prefill: bool) -> None:
    batch, config, k, v, _, q, sinks = case(3, [30, 7], [30, 7] if prefill else [1, 1], 2, 3, 16, 4)
    plan = plan_attention(batch, config, 4, 2)
    without = attend(plan, q, k, v)
    np.testing.assert_array_equal(attend(plan, q, k, v, sinks=np.full_like(sinks, -1e4)), without)
    assert np.abs(attend(plan, q, k, v, sinks=np.full_like(sinks, 1e3))).max() < 1e-30
    assert np.abs(attend(plan, q, k, v, sinks=sinks) - without).max() > 1e-2


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=6), kv_heads=st.sampled_from([1, 2, 8]),
       group=st.sampled_from([1, 3, 4, 8]), kv_dtype=st.sampled_from(KV_CACHE_DTYPES),   # 8 x 8: gpt-oss's heads
       block_size=st.sampled_from([1, 4, 16]), head_dim=st.sampled_from([32, 64, 128]),
       window=st.sampled_from([0, 5, 40]), by_position=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_decode_kernel_takes_the_sinks_as_numpy_does(
        lens: list[int], kv_heads: int, group: int, kv_dtype: str, block_size: int, head_dim: int, window: int,
        by_position: bool, seed: int) -> None:
    """Every storage type, head by head or position by position, on the engine's pool and on the
    compiled products' threads: the numpy path's output."""
    batch, config, k, v, scales, q, sinks = case(seed, lens, [1] * len(lens), kv_heads, group, head_dim,
                                                 block_size, kv_dtype)
    want = attend(plan_attention(batch, config, block_size, 2, window=window), q, k, v, scales=scales, sinks=sinks)
    products.pool_threads(2)
    before = compiled.decode_by_position(1 if by_position else 1 << 40)
    try:
        for on_pool in (False, True):
            plan = plan_attention(batch, config, block_size, 2, fused=True, window=window, decode_on_pool=on_pool)
            got = attend(plan, q, k, v, scales=scales, sinks=sinks)
            assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    finally:
        compiled.decode_by_position(before)


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
def test_the_decode_kernel_built_without_avx512_takes_the_sinks_alike(kv_dtype: str) -> None:
    """The AVX2 build's one-key-at-a-time path (and its position-by-position one for MHA) give the
    native build's outputs (which the test above checks against numpy)."""
    for kv_heads, group in ((2, 3), (8, 1)):
        batch, _, k, v, scales, q, sinks = case(5, [1, 17, 40, 33], [1] * 4, kv_heads, group, 64, 4, kv_dtype)
        outs = []
        for isa in ("native", "avx2"):
            out = np.zeros_like(q)
            compiled.paged_decode_attention(q, k, v, batch.query_start[:-1].copy(), batch.block_tables,
                                            batch.context_lens, np.empty(group * 40, np.float32), out, scales=scales,
                                            lib=compiled.library_at(isa), sinks=sinks)
            outs.append(out)
        assert np.max(np.abs(outs[1] - outs[0])) <= 1e-5 * max(1.0, float(np.max(np.abs(outs[0]))))


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(4, 200), min_size=1, max_size=4), cached=st.floats(0.0, 0.9),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 8]), head_dim=st.sampled_from([32, 64]),
       block_size=st.sampled_from([1, 16]), window=st.sampled_from([0, 5, 40]),
       kv_dtype=st.sampled_from(KV_CACHE_DTYPES), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_prefill_kernel_takes_the_sinks_as_numpy_does(
        lens: list[int], cached: float, kv_heads: int, group: int, head_dim: int, block_size: int, window: int,
        kv_dtype: str, seed: int) -> None:
    """Prompt chunks (after a cached prefix or not, a sliding window or none, every storage type):
    the online softmax that starts from the sink gives the numpy path's output."""
    if not prefill_kernel.prefill_attention_supports(head_dim):
        pytest.skip("the compiled prefill kernel needs AVX-512")
    query_lens = [max(4, n - int(n * cached)) for n in lens]
    batch, config, k, v, scales, q, sinks = case(seed, lens, query_lens, kv_heads, group, head_dim, block_size,
                                                 kv_dtype)
    want = attend(plan_attention(batch, config, block_size, 2, window=window), q, k, v, scales=scales, sinks=sinks)
    plan = plan_attention(batch, config, block_size, 2, fused=True, window=window)
    assert plan.fused_prefill
    got = attend(plan, q, k, v, scales=scales, sinks=sinks)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))


def test_the_fast_prefill_takes_the_sinks_too() -> None:
    """The `fast` numerics multiply bfloat16 pairs, the softmax stays float32: the numpy attention of
    the rounded queries, keys and values with the sinks, within the weights' rounding, and far from
    it without the sinks (where AVX-512 BF16 is missing, the float32 kernel's output)."""
    if not prefill_kernel.prefill_attention_supports(64):
        pytest.skip("the compiled prefill kernel needs AVX-512")
    batch, config, k, v, _, q, sinks = case(7, [120, 60], [120, 50], 2, 3, 64, 16)
    plan = plan_attention(batch, config, 16, 2, fused=True)
    got = attend(plan, q, k, v, fast=True, sinks=sinks)
    if products.qmatmul_fast_kind(compiled.library_at("native")) not in ("bfloat16", "int8+bfloat16"):
        np.testing.assert_array_equal(got, attend(plan, q, k, v, sinks=sinks))
        return

    def bf16(a: np.ndarray) -> np.ndarray:
        return to_float32(to_storage(a, np.dtype(storage_dtype("bfloat16"))))

    want = attend(plan_attention(batch, config, 16, 2), bf16(q), bf16(k), bf16(v), sinks=sinks)
    bound = 2.0**-8 * float(np.max(np.abs(v))) + 1e-5
    assert np.max(np.abs(got - want)) <= bound
    assert np.max(np.abs(attend(plan, q, k, v, fast=True) - want)) > 100 * bound


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    batch, _, k, v, _, q, sinks = case(1, [9], [1], 2, 2, 32, 4)
    rows = batch.query_start[:-1].copy()
    for bad in (sinks[:-1], sinks.astype(np.float64), np.repeat(sinks, 2)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            compiled.paged_decode_attention(q, k, v, rows, batch.block_tables, batch.context_lens,
                                            np.empty(18, np.float32), np.zeros_like(q), sinks=bad)
