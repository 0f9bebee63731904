"""The deterministic numerics' attention (forge/kernels/det_attention.c): every build level this host can run
gives its numpy definition's bits (forge.kernels.det_attention_reference) over a paged cache with scattered block
tables, and a query row's output does not depend on how its rows are cut into segments (a decode row, a prompt
chunk of any size, among other sequences, on one thread or many)."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.kernels import compiled, products
from forge.kernels.det_attention import det_attention, segments
from forge.kernels.det_attention_reference import det_attention_reference
from forge.models.llama.attention import attend
from forge.models.llama.attention_plan import plan_attention
from tests.unit.test_attention_sinks import by_definition, case
from tests.unit.test_block_linear import RUNNABLE

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@pytest.fixture(scope="module", params=RUNNABLE)
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    built = compiled.library() if request.param == "native" else compiled.library_at(request.param)
    assert built is not None
    products.pool_threads(2, lib=built)
    return built


def paged(rng: np.random.Generator, lengths: list[int], nkv: int, hd: int, block_size: int,
          dtype: str) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.generic], I64]:
    """K/V caches holding sequences of `lengths` keys in scattered blocks, and their block tables."""
    width = max(-(-n // block_size) for n in lengths)
    num_blocks = width * len(lengths) + 3
    order = rng.permutation(num_blocks)
    tables = order[: width * len(lengths)].reshape(len(lengths), width).astype(np.int64)
    shape = (num_blocks, block_size, nkv, hd)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if dtype == "float16":
        return k.astype(np.float16), v.astype(np.float16), tables
    if dtype == "bfloat16":
        return (k.view(np.uint32) >> 16).astype(np.uint16), (v.view(np.uint32) >> 16).astype(np.uint16), tables
    return k, v, tables


def bits(a: F32) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a).view(np.uint32)


def run(lib: ctypes.CDLL, q: F32, k: npt.NDArray[np.generic], v: npt.NDArray[np.generic], tables: I64, segs: I64,
        **kw: object) -> F32:
    out = np.zeros_like(q)
    det_attention(q, k, v, tables, segs, out, lib=lib, **kw)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(("dtype", "nh", "nkv", "hd", "block_size", "window", "softcap", "with_sinks"), [
    ("float16", 6, 2, 64, 16, 0, 0.0, False),
    ("float32", 4, 4, 32, 8, 0, 0.0, False),
    ("bfloat16", 8, 2, 48, 16, 0, 0.0, False),
    ("float16", 6, 2, 64, 4, 21, 0.0, True),
    ("float32", 4, 1, 40, 16, 0, 30.0, False),
    ("float16", 10, 2, 128, 16, 0, 0.0, True),
    ("bfloat16", 8, 8, 72, 8, 40, 0.0, False),
])
def test_every_level_is_the_definition(lib: ctypes.CDLL, dtype: str, nh: int, nkv: int, hd: int, block_size: int,
                                       window: int, softcap: float, with_sinks: bool) -> None:
    rng = np.random.default_rng(hd + nh)
    # sequence 0: a decode row at position 70; 1: a prompt chunk of 37 rows from position 5; 2: a chunk from 0;
    # 3: a decode row at position 0
    lengths = [71, 42, 19, 1]
    k, v, tables = paged(rng, lengths, nkv, hd, block_size, dtype)
    starts = np.array([0, 1, 38, 57, 58], dtype=np.int64)
    positions = np.concatenate([[70], np.arange(5, 42), np.arange(19), [0]]).astype(np.int64)
    q = (rng.standard_normal((58, nh, hd)) * 0.3).astype(np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32) if with_sinks else None
    segs = segments(starts, positions, rows=16)
    want = det_attention_reference(q, k, v, tables, segs, window, softcap, sinks)
    got = run(lib, q, k, v, tables, segs, window=window, softcap=softcap, sinks=sinks)
    assert np.array_equal(bits(got), bits(want))
    assert np.isfinite(want).all()


def test_a_row_is_the_same_however_its_rows_are_cut(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(7)
    nh, nkv, hd = 9, 3, 64
    k, v, tables = paged(rng, [200], nkv, hd, 16, "float16")
    q = (rng.standard_normal((200, nh, hd)) * 0.3).astype(np.float32)
    positions = np.arange(200, dtype=np.int64)
    whole = run(lib, q, k, v, tables, segments(np.array([0, 200]), positions), parallel=False)
    for cut in (1, 7, 16, 50, 128):
        starts = np.array(list(range(0, 200, cut)) + [200], dtype=np.int64)
        chunked = run(lib, q, k, v, np.repeat(tables, len(starts) - 1, axis=0), segments(starts, positions, rows=cut))
        assert np.array_equal(bits(chunked), bits(whole)), cut
    # the last row as a decode row alone, its query in row 0 of a step among another sequence's rows
    k2, v2, tables2 = paged(rng, [200, 90], nkv, hd, 16, "float16")
    k2[tables2[0]], v2[tables2[0]] = k[tables[0]], v[tables[0]]
    q2 = np.concatenate([q[199:], (rng.standard_normal((90, nh, hd))).astype(np.float32)])
    segs2 = np.array([[0, 0, 1, 199], [1, 1, 90, 0]], dtype=np.int64)
    assert np.array_equal(bits(run(lib, q2, k2, v2, tables2, segs2)[0]), bits(whole[199]))


def test_bad_arguments_are_refused(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(3)
    k, v, tables = paged(rng, [20], 2, 32, 16, "float32")
    q = np.zeros((4, 4, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="outside"):
        run(lib, q, k, v, tables, np.array([[0, 0, 4, 30]], dtype=np.int64))
    with pytest.raises(ValueError, match="caches"):
        run(lib, q, k.astype(np.int8), v.astype(np.int8), tables, np.array([[0, 0, 4, 0]], dtype=np.int64))


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(1, 60), min_size=1, max_size=5),
       prefill=st.lists(st.booleans(), min_size=5, max_size=5),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), block_size=st.sampled_from([1, 4, 16]),
       window=st.sampled_from([0, 5]), seed=st.integers(0, 2**32 - 1))
def test_the_models_attention_in_these_numerics_is_attention(lens: list[int], prefill: list[bool], kv_heads: int,
                                                              group: int, block_size: int, window: int,
                                                              seed: int) -> None:
    """forge.models.llama.attention with a plan for the deterministic numerics (decode rows and prompt chunks in
    one step, a window, sinks): each row's softmax over its keys, written out in float64, within float32's error;
    and the kernel's definition (det_attention_reference) bit for bit."""
    query_lens = [n if p else 1 for n, p in zip(lens, prefill, strict=False)]
    batch, config, k, v, _, q, sinks = case(seed, lens, query_lens, kv_heads, group, 16, block_size)
    plan = plan_attention(batch, config, block_size, window=window, det=True)  # type: ignore[arg-type]
    assert plan.det is not None and not plan.decode_parts and not plan.prefill_parts
    got = attend(plan, q, k, v, sinks=sinks)
    np.testing.assert_allclose(got, by_definition(batch, q, k, v, sinks, window), atol=2e-5, rtol=0)
    want = det_attention_reference(q, k, v, plan.det.tables, plan.det.segments, plan.window, 0.0, sinks)
    assert np.array_equal(bits(got), bits(want))
