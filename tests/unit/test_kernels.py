"""The kernel layer against its numpy reference.

forge.kernels.quant_blocks must reproduce the gguf package's dequantization bit for bit for every block
type; the onnxruntime kernel must multiply by exactly those values (float32 arithmetic: agreement
to float32 rounding), fused parts of different types included; `fast` (int8 activations) must stay
within its documented tolerance; a model loaded with the kernels must agree with the numpy model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.config import KV_CACHE_DTYPES
from forge.kernels import KERNELS, NUMERICS, choose_kernels, compiled, prefill_kernel, products
from forge.kernels.onnx_linear import ACCURACY_FP32, ACCURACY_INT8, OnnxLinear
from forge.kernels.quant_blocks import SUPPORTED, AffineBlocks, affine_blocks
from forge.models.forward_batch import ForwardBatch
from forge.models.llama import linear as linear_mod
from forge.models.llama.attention import attend
from forge.models.llama.attention_plan import AttentionPlan, plan_attention
from forge.models.llama.kv_cache import KVCache
from forge.models.llama.kv_dtype import (
    INT8_GROUP,
    dequantize_int8,
    hadamard32,
    quantize_int8,
    storage_dtype,
    to_float32,
    to_storage,
)
from forge.models.llama.linear import MatmulPool, Q8Matrix
from forge.models.llama.llama_model import LlamaModel
from forge.models.llama.tensor_source import QuantEmbedding
from tests.tiny_gguf import write_tiny_llama

Q = GGMLQuantizationType
# Where each type keeps its float16 scales (byte offsets in a block); the rest of a block is any bytes
# (MXFP4's scale, an E8M0 exponent byte at 0, is drawn as the others' are: 2^-16 .. 2^-1).
F16_AT = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
          Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
          Q.MXFP4: ()}


def random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int,
                  scale: float = 0.05) -> npt.NDArray[np.uint8]:
    """Random GGUF data for an [rows, cols] tensor: random codes, finite random float16 scales."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // elems * nbytes), dtype=np.uint8)
    blocks = data.reshape(-1, nbytes)
    for at in F16_AT[qtype]:
        d = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(112, 128, len(blocks))
    return data


def reference_product(x: npt.NDArray[np.float32], parts: list[AffineBlocks]) -> npt.NDArray[np.float64]:
    w = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)        # [N, K]
    return x.astype(np.float64) @ w.T                                             # [T, N]


def term_magnitude(x: npt.NDArray[np.float32], parts: list[AffineBlocks]) -> npt.NDArray[np.float64]:
    """|x| @ |W|.T: the size of each output's terms, what float32 rounding of a dot product scales
    with (an output that cancels to near zero still carries its terms' rounding)."""
    w = np.concatenate([p.dequantize() for p in parts]).astype(np.float64)        # [N, K]
    return np.abs(x.astype(np.float64)) @ np.abs(w).T                             # [T, N]


# float32 rounding of the kernel's sum of planes and offsets, relative to the size of each output's
# terms. One 4-bit plane rounds like numpy's own float32 product (~2e-7 measured); two planes (5- to
# 8-bit codes) sum larger partial terms that mostly cancel, so they round more (3e-6 measured).
EXACT = 2e-5


def assert_close(got: npt.NDArray[np.float32], want: npt.NDArray[np.float64], rel: float,
                 scale: npt.NDArray[np.float64] | None = None) -> None:
    """Agreement within rel of `scale`, each output's own (term_magnitude), or by default the
    largest output."""
    bound = rel * (np.max(np.abs(want)) + 1e-30 if scale is None else scale + 1e-30)
    assert got.shape == want.shape and got.dtype == np.float32
    err = np.abs(got - want)
    assert np.all(err <= bound), np.max(err / bound) * rel


@given(shape=st.lists(st.integers(0, 7), min_size=1, max_size=3), start=st.integers(0, 3),
       dtype=st.sampled_from([np.float32, np.float16, np.int8, np.int64, np.uint16]))
def test_a_kernel_argument_is_the_arrays_data(shape: list[int], start: int, dtype: type) -> None:
    """compiled.ptr (what every kernel call passes) is the array's data pointer: for arrays, views
    that start inside another array, read-only arrays and empty ones alike."""
    base = np.arange(int(np.prod(shape)) + 4).astype(dtype)
    for a in (base, base[start:], base[start:][: int(np.prod(shape))].reshape(shape)):
        assert compiled.ptr(a) == a.ctypes.data
    base.flags.writeable = False
    assert compiled.ptr(base[start:]) == base[start:].ctypes.data


qtypes = st.sampled_from(SUPPORTED)


@settings(max_examples=80, deadline=None)
@given(qtype=qtypes, rows=st.integers(1, 9), num_blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_integer_codes_reproduce_the_gguf_dequantization_exactly(qtype: GGMLQuantizationType, rows: int,
                                                                  num_blocks: int, seed: int) -> None:
    elems = GGML_QUANT_SIZES[qtype][0]
    data = random_blocks(np.random.default_rng(seed), qtype, rows, elems * num_blocks)
    blocks = affine_blocks(data, qtype, (rows, elems * num_blocks))
    assert blocks.codes.dtype == np.uint8 and int(blocks.codes.max()) < 2 ** blocks.bits
    assert np.array_equal(blocks.dequantize(), dequantize(data, qtype).reshape(rows, -1))


def test_the_table_types_over_every_scale_and_index() -> None:
    """MXFP4 with every scale byte (2^-128 and 2^-127 subnormal) and IQ4_XS with every six-bit scale,
    each with every 4-bit index: the integer codes (MXFP4's while 24 times the scale stays finite, up
    to byte 251) and the compiled widening (every byte) give the gguf package's values bit for bit."""
    rng = np.random.default_rng(9)
    every_index = (np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4))     # 16 bytes
    mxfp4 = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], np.tile(every_index, (256, 1))], axis=1)
    xs = rng.integers(0, 256, size=(8, 136), dtype=np.uint8)                  # 8 super-blocks of 8 sub-blocks
    xs[:, 0:2] = rng.uniform(1e-4, 0.01, 8).astype(np.float16).view(np.uint8).reshape(8, 2)
    ls = np.arange(64).reshape(8, 8)                                          # every six-bit scale once
    xs[:, 2:4] = (((ls >> 4) << (2 * np.arange(8))).sum(axis=1)).astype(np.uint16).view(np.uint8).reshape(8, 2)
    xs[:, 4:8] = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    xs[:, 8:] = np.tile(every_index, 8)
    for qtype, data, exact_rows in ((Q.MXFP4, mxfp4, 252), (Q.IQ4_XS, xs, 8)):
        k = GGML_QUANT_SIZES[qtype][0]
        with np.errstate(all="ignore"):
            want = dequantize(data, qtype).reshape(len(data), k)
        codes = affine_blocks(data[:exact_rows], qtype, (exact_rows, k))
        np.testing.assert_array_equal(codes.dequantize(), want[:exact_rows])
        if compiled.library() is not None:
            np.testing.assert_array_equal(products.dequant_rows(data, int(qtype), k, np.arange(len(data))), want)


@settings(max_examples=30, deadline=None)
@given(qtype=qtypes, rows=st.integers(1, 70), num_blocks=st.integers(1, 3), num_tokens=st.integers(1, 9),
       seed=st.integers(0, 2**32 - 1))
def test_the_onnxruntime_kernel_multiplies_by_exactly_the_files_values(
        qtype: GGMLQuantizationType, rows: int, num_blocks: int, num_tokens: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    cols = GGML_QUANT_SIZES[qtype][0] * num_blocks
    parts = [affine_blocks(random_blocks(rng, qtype, rows, cols), qtype, (rows, cols))]
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    linear = OnnxLinear(parts, num_threads=2)
    assert linear.shape == (cols, rows)
    assert_close(linear.matmul(x), reference_product(x, parts), rel=EXACT, scale=term_magnitude(x, parts))


def test_fused_parts_of_different_types_and_block_sizes() -> None:
    """A Q4_K_M file mixes types within one fused matrix (q/k in Q4_K, v in Q6_K)."""
    rng = np.random.default_rng(1)
    cols = 512
    parts = [affine_blocks(random_blocks(rng, t, rows, cols), t, (rows, cols))
             for t, rows in ((Q.Q4_K, 40), (Q.Q4_K, 8), (Q.Q6_K, 8), (Q.Q4_0, 3))]
    linear = OnnxLinear(parts, num_threads=1)
    assert (linear.block_size, linear.num_planes) == (16, 2)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    assert_close(linear.matmul(x), reference_product(x, parts), rel=EXACT, scale=term_magnitude(x, parts))


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 300])
def test_edge_sizes_one_row_one_block_and_many_tokens(num_tokens: int) -> None:
    rng = np.random.default_rng(num_tokens)
    parts = [affine_blocks(random_blocks(rng, Q.Q4_1, 1, 32), Q.Q4_1, (1, 32))]
    x = rng.standard_normal((num_tokens, 32)).astype(np.float32)
    assert_close(OnnxLinear(parts, num_threads=2).matmul(x), reference_product(x, parts), rel=EXACT,
                 scale=term_magnitude(x, parts))


def test_int8_activations_stay_within_their_documented_tolerance() -> None:
    rng = np.random.default_rng(2)
    parts = [affine_blocks(random_blocks(rng, Q.Q4_1, 96, 256), Q.Q4_1, (96, 256))]
    x = rng.standard_normal((4, 256)).astype(np.float32)
    exact = OnnxLinear(parts, num_threads=2, accuracy_level=ACCURACY_FP32).matmul(x)
    fast = OnnxLinear(parts, num_threads=2, accuracy_level=ACCURACY_INT8).matmul(x)
    want = reference_product(x, parts)
    assert_close(exact, want, rel=EXACT, scale=term_magnitude(x, parts))
    assert_close(fast, want, rel=3e-2)
    assert not np.array_equal(fast, exact)        # it really is the other arithmetic


def test_backends_are_chosen_by_name() -> None:
    assert choose_kernels("numpy").backend == "numpy"
    # auto: the file's blocks where the compiled kernels have AVX-512 (AMX hosts too: the tiles
    # only by name), else onnxruntime (installed with forge)
    wide = products.qmatmul_lanes() == 16
    assert choose_kernels("auto").backend == ("blocks" if wide else "onnxruntime")
    assert choose_kernels("blocks").name == "blocks"
    fast = choose_kernels("fast")
    assert (fast.backend, fast.int8_activations, fast.name) == ("onnxruntime", True, "fast")
    assert set(KERNELS) == {"auto", "blocks", "amx", "onnxruntime", "fast", "numpy"}
    assert not choose_kernels("auto").amx                           # the tiles only when asked for
    if products.amx_ready():
        assert choose_kernels("amx").name == "amx"
    assert not choose_kernels("onnxruntime").amx and choose_kernels("onnxruntime").name == "onnxruntime"
    with pytest.raises(ValueError, match="kernels must be one of"):
        choose_kernels("cuda")



def test_numerics_are_chosen_apart_from_the_backend() -> None:
    """reference everywhere by default; fast is bfloat16 on blocks (where the CPU has AVX-512
    BF16), int8 activations on onnxruntime, and refused where a backend has no such numerics."""
    assert set(NUMERICS) == {"reference", "fast", "deterministic"}
    for name in ("auto", "blocks", "onnxruntime", "numpy"):
        assert choose_kernels(name).numerics == "reference"
    assert choose_kernels("fast").numerics == "fast"                    # the named backend keeps its meaning
    onnx = choose_kernels("onnxruntime", "fast")
    assert (onnx.backend, onnx.int8_activations, onnx.numerics) == ("onnxruntime", True, "fast")
    with pytest.raises(ValueError, match="no fast numerics"):
        choose_kernels("numpy", "fast")
    with pytest.raises(ValueError, match="numerics must be one of"):
        choose_kernels("auto", "exact")
    if products.qmatmul_fast():
        for name in ("auto", "blocks"):
            chosen = choose_kernels(name, "fast")
            assert (chosen.backend, chosen.fast_products, chosen.amx) == ("blocks", True, False)
            assert chosen.numerics == "fast"
    else:
        with pytest.raises(ValueError, match="AVX-512 BF16"):
            choose_kernels("blocks", "fast")
        assert choose_kernels("auto", "fast").int8_activations           # onnxruntime's fast numerics instead


@pytest.mark.parametrize("quant", ["Q4_0", "Q4_1", "Q8_0", "Q5_1"])
def test_a_model_on_the_kernels_agrees_with_the_numpy_reference(tmp_path: Path, quant: str) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", quant=quant, hidden=64, heads=4, kv_heads=2, ffn=128, seed=3)
    reference = LlamaModel.load(path)
    quantized = LlamaModel.load(path, choose_kernels("onnxruntime"))
    assert quantized.weights.kernels == "onnxruntime" and not quantized.weights.is_dense
    assert isinstance(quantized.weights.embedding, QuantEmbedding)
    assert quantized.weights.nbytes < reference.weights.nbytes / 2
    context = [5, 9, 3, 17, 40, 2, 33]
    want, got = reference.forward_context(context), quantized.forward_context(context)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


def test_unsupported_types_stay_dense_under_the_kernels(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", quant="F16", hidden=64, ffn=128)
    model = LlamaModel.load(path, choose_kernels("onnxruntime"))
    assert model.weights.is_dense


# ---- the AMX product of big steps (bfloat16x3) ----------------------------------------------------

# bfloat16x3 keeps ~16 significant bits of each factor: each output within this much of the size
# of its terms (term_magnitude); ~1e-5 is what it gives.
BF16X3 = 6e-5


def amx_here() -> bool:
    """Whether this host runs the AMX kernels. Where it cannot, what the tests check is the refusal:
    `auto` must not pick them and asking for them by name must fail with a clear error."""
    if products.amx_ready():
        return True
    assert not choose_kernels("auto").amx
    with pytest.raises(ValueError, match="AMX"):
        choose_kernels("amx")
    return False


@settings(max_examples=30, deadline=None)
@given(qtype=qtypes, panels=st.integers(1, 3), num_blocks=st.integers(1, 3), num_tokens=st.integers(1, 100),
       seed=st.integers(0, 2**32 - 1))
def test_the_amx_product_agrees_with_the_files_values(qtype: GGMLQuantizationType, panels: int, num_blocks: int,
                                                      num_tokens: int, seed: int) -> None:
    """Every block type (one plane and two, blocks of 16 and 32), any row count (the last rows of a
    32-row tile), each column range a thread may take."""
    if not amx_here():
        return
    rng = np.random.default_rng(seed)
    rows, cols = 32 * panels, GGML_QUANT_SIZES[qtype][0] * num_blocks
    parts = [affine_blocks(random_blocks(rng, qtype, rows, cols), qtype, (rows, cols))]
    linear = OnnxLinear(parts, num_threads=1, amx=True)
    assert linear.dense_rows is not None
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    want, scale = reference_product(x, parts), term_magnitude(x, parts)
    out = np.full((num_tokens, rows), np.nan, dtype=np.float32)
    split = linear.split_rows(x)
    for cut in linear.column_cuts(int(rng.integers(1, 4))):
        linear.dense_into(split, out, cut)
    assert_close(out, want, rel=BF16X3, scale=scale)


def test_big_steps_take_the_amx_tiles_and_small_ones_onnxruntime() -> None:
    if not amx_here():
        return
    rng = np.random.default_rng(5)
    parts = [affine_blocks(random_blocks(rng, Q.Q4_1, 96, 256), Q.Q4_1, (96, 256))]
    linear = OnnxLinear(parts, num_threads=2, amx=True)
    assert linear.dense_rows is not None and linear.column_cuts(2) == [(0, 64), (64, 96)]
    pool = MatmulPool("split", 2)
    try:
        for num_tokens in (linear.dense_rows - 1, linear.dense_rows, 300):
            x = rng.standard_normal((num_tokens, 256)).astype(np.float32)
            want, scale = reference_product(x, parts), term_magnitude(x, parts)
            whole, split = linear.matmul(x), pool.matmul(x, linear)
            assert_close(whole, want, rel=BF16X3, scale=scale)
            np.testing.assert_array_equal(split, whole)       # the threads' columns add up to the whole
            amx_step = num_tokens >= linear.dense_rows
            # below dense_rows it is onnxruntime's float32 product, to float32 rounding
            assert amx_step or np.all(np.abs(whole - want) <= EXACT * scale + 1e-30)
    finally:
        pool.close()


def test_the_amx_tiles_are_not_used_where_they_cannot_be() -> None:
    """Sizes off the 32-column panels, int8 activations, and kernels not asked for amx keep
    onnxruntime's path (and no second copy of the planes)."""
    rng = np.random.default_rng(6)
    odd = [affine_blocks(random_blocks(rng, Q.Q4_1, 40, 256), Q.Q4_1, (40, 256))]
    even = [affine_blocks(random_blocks(rng, Q.Q4_1, 64, 256), Q.Q4_1, (64, 256))]
    assert OnnxLinear(odd, num_threads=1, amx=True).dense_rows is None
    assert OnnxLinear(even, num_threads=1, amx=True, accuracy_level=ACCURACY_INT8).dense_rows is None
    plain = OnnxLinear(even, num_threads=1)
    assert plain.dense_rows is None
    if amx_here():
        assert OnnxLinear(even, num_threads=1, amx=True).nbytes > plain.nbytes


def test_a_model_on_the_amx_kernels_agrees_with_the_numpy_reference(tmp_path: Path) -> None:
    """A prompt long enough for the AMX path, then decoding steps on onnxruntime's."""
    if not amx_here():
        return
    path = write_tiny_llama(tmp_path / "m.gguf", quant="Q4_1", hidden=64, heads=4, kv_heads=2, ffn=128, seed=3)
    reference = LlamaModel.load(path)
    model = LlamaModel.load(path, choose_kernels("amx"))
    assert model.weights.kernels == "amx"
    assert all(w.dense_rows is not None for w in (model.weights.layers[0].wqkv, model.weights.layers[0].w_down))
    context = np.random.default_rng(4).integers(3, 60, 150).tolist()
    want, got = reference.forward_context(context), model.forward_context(context)
    assert np.max(np.abs(got - want)) <= 1e-4 * np.max(np.abs(want))


# ---- the compiled decode attention ------------------------------------------------------------

def test_the_compiled_kernels_build_here_and_leave_the_process_float_mode_alone() -> None:
    """CI installs a C compiler (scripts/install-test-deps): the fused path must be what runs.
    Loading it must not switch the process to flush-to-zero (a library linked with -ffast-math
    does), which would turn every denormal in numpy and msgspec into 0."""
    assert compiled.library() is not None, compiled.status()
    tiny = np.float64(5e-324)
    assert tiny > 0 and np.float32(1e-45) > 0 and tiny * 2 == np.float64(1e-323)


def paged_batch(rng: np.random.Generator, lens: list[int], query_lens: list[int], block_size: int,
                num_blocks: int) -> ForwardBatch:
    """Sequences of the given context lengths, each computing its last query_lens tokens this step,
    their blocks scattered over the cache."""
    width = max(-(-n // block_size) for n in lens)
    free = rng.permutation(num_blocks)
    tables = np.zeros((len(lens), width), dtype=np.int64)
    used = 0
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[s, :nb] = free[used:used + nb]
        used += nb
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lens, query_lens, strict=True)])
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    return ForwardBatch(token_ids=np.zeros(len(positions), np.int64), positions=positions.astype(np.int64),
                        slot_mapping=np.zeros(len(positions), np.int64), query_start=starts,
                        context_lens=np.array(lens, dtype=np.int64), block_tables=tables,
                        sample_indices=starts[1:] - 1)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 90), min_size=1, max_size=9), kv_heads=st.sampled_from([1, 2, 3, 8]),
       group=st.sampled_from([1, 2, 3, 4]), block_size=st.sampled_from([1, 4, 16]), num_parts=st.integers(1, 3),
       prefill_every=st.integers(0, 3), window=st.sampled_from([0, 1, 5, 40]),
       softcap=st.sampled_from([0.0, 0.5, 3.0]), seed=st.integers(0, 2**32 - 1))
def test_fused_decode_attention_equals_the_numpy_reference(
        lens: list[int], kv_heads: int, group: int, block_size: int, num_parts: int, prefill_every: int,
        window: int, softcap: float, seed: int) -> None:
    """Decode rows through the compiled kernel (mixed with prefill chunks, split over parts, with or
    without a sliding window, with or without soft-capped scores; 8 KV heads of one query head each go
    position by position) give the numpy path's output."""
    rng = np.random.default_rng(seed)
    head_dim = int(rng.choice([16, 32, 48, 64, 128]))            # 64 and 128: the outputs in registers
    # Chunks up to 12 rows: up to MAX_FUSED_CHUNK_ROWS (8) they run on the kernel row by row.
    query_lens = [min(n, 12) if prefill_every and s % prefill_every == 0 else 1 for s, n in enumerate(lens)]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    batch = paged_batch(rng, lens, query_lens, block_size, num_blocks)
    config = SimpleNamespace(num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)
    k = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
    q = (rng.standard_normal((batch.num_tokens, kv_heads * group, head_dim)) / 4).astype(np.float32)
    want = attend(plan_attention(batch, config, block_size, num_parts, window=window, softcap=softcap), q, k, v)
    fused_plan = plan_attention(batch, config, block_size, num_parts, fused=True, window=window, softcap=softcap)
    assert fused_plan.fused_parts or not any(n == 1 for n in query_lens)
    got = attend(fused_plan, q, k, v)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    assert_the_pool_gives_the_same(batch, config, block_size, num_parts, window, softcap, q, k, v, fused_plan, got)


def assert_the_pool_gives_the_same(batch: ForwardBatch, config: SimpleNamespace, block_size: int, num_parts: int,
                                   window: int, softcap: float, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                                   fused_plan: AttentionPlan, got: np.ndarray,
                                   scales: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The decode rows as one call split by (row, KV head) over the compiled products' two
    threads give the same bits as the parts on the engine's pool."""
    products.pool_threads(2)
    pool_plan = plan_attention(batch, config, block_size, num_parts, fused=True, window=window, softcap=softcap,
                               decode_on_pool=True)
    assert (pool_plan.pool_decode is not None) == bool(fused_plan.fused_parts) and not pool_plan.fused_parts
    np.testing.assert_array_equal(attend(pool_plan, q, k, v, scales=scales), got)


def test_the_compiled_kernel_refuses_arrays_it_would_misread() -> None:
    q = np.zeros((1, 3, 16), np.float32)
    k = np.zeros((2, 4, 1, 16), np.float32)
    rows, tables, lens = np.zeros(1, np.int64), np.zeros((1, 1), np.int64), np.ones(1, np.int64)
    with pytest.raises(ValueError, match="C-contiguous"):
        compiled.paged_decode_attention(q, k, k, rows, tables.astype(np.int32), lens, np.zeros(3, np.float32), q)
    with pytest.raises(ValueError, match="scratch"):
        compiled.paged_decode_attention(q, k, k, rows, tables, lens * 3, np.zeros(3, np.float32), q)
    for first in (-1, 1):                                   # before the first key, or past the last
        with pytest.raises(ValueError, match="first_keys"):
            compiled.paged_decode_attention(q, k, k, rows, tables, lens, np.zeros(3, np.float32), q,
                                            np.full(1, first, np.int64))


def test_the_model_runs_compiled_ops_only_off_the_numpy_reference(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", quant="Q4_0", hidden=64, heads=4, kv_heads=2, ffn=128, seed=4)
    assert not LlamaModel.load(path).compiled_ops
    assert LlamaModel.load(path, choose_kernels("onnxruntime")).compiled_ops


# ---- half-precision K/V -------------------------------------------------------------------------

finite_or_not = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(finite_or_not, min_size=1, max_size=64))
def test_bfloat16_storage_rounds_to_nearest_even_and_reads_back_exactly(values: list[float]) -> None:
    """Against ml_dtypes' bfloat16 (the type numpy lacks): the same bits for every float32, NaN
    stays NaN, infinities and signed zeros survive, and reading widens exactly."""
    x = np.array(values, dtype=np.float32)
    bits = to_storage(x, np.dtype(np.uint16))
    want = x.astype(ml_dtypes.bfloat16)
    back = to_float32(bits)
    nan = np.isnan(x)
    assert np.array_equal(bits[~nan], want.view(np.uint16)[~nan]) and np.isnan(back[nan]).all()
    assert np.array_equal(back[~nan], want.astype(np.float32)[~nan])
    assert np.array_equal(np.signbit(back[~nan]), np.signbit(x[~nan]))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(finite_or_not, min_size=1, max_size=64))
def test_float16_storage_is_numpys_rounding(values: list[float]) -> None:
    x = np.array(values, dtype=np.float32)
    with np.errstate(over="ignore"):
        stored = to_storage(x, np.dtype(np.float16))
        want = x.astype(np.float16)
    assert stored.dtype == np.float16 and np.array_equal(stored, want, equal_nan=True)
    assert np.array_equal(to_float32(stored), want.astype(np.float32), equal_nan=True)


# ---- the int8 K/V cache ------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 6), groups=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       magnitude=st.sampled_from([1e-30, 1e-7, 1e-3, 1.0, 300.0, 1e4]),
       specials=st.lists(st.sampled_from([0.0, -0.0, 127.0, -1e-40, 2e5]), max_size=4))
def test_the_int8_writer_is_the_numpy_quantiser_and_rounds_within_half_a_step(
        rows: int, groups: int, seed: int, magnitude: float, specials: list[float]) -> None:
    """The compiled writer stores the same bits as forge.models.llama.kv_dtype.quantize_int8 at the given
    slots (and nothing elsewhere); reading back is within half a quantization step of every
    rotated value (scales rounded to float16, subnormal ones included; all-zero groups stay zero),
    and rotating back by H / 32 returns the values to within a step."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 2, groups * INT8_GROUP)) * magnitude).astype(np.float32)
    x.reshape(-1)[: len(specials)] = specials
    if rng.random() < 0.3:
        x[0, 0, :INT8_GROUP] = 0.0
    q, scales = quantize_int8(x)
    num_slots = rows + 5
    values = np.full((num_slots, 1, 2, groups * INT8_GROUP), 7, np.int8)
    stored = np.full((num_slots, 1, 2, groups), 3.0, np.float16)
    slots = rng.permutation(num_slots)[:rows].astype(np.int64)
    compiled.kv_store(np.ascontiguousarray(x), slots, values, stored)
    assert np.array_equal(values[slots, 0], q)
    assert np.array_equal(stored[slots, 0].view(np.uint16), scales.view(np.uint16))
    untouched = np.setdiff1d(np.arange(num_slots), slots)
    assert (values[untouched] == 7).all() and (stored[untouched] == 3.0).all()
    back = dequantize_int8(q, scales)
    step = np.repeat(scales.astype(np.float64), INT8_GROUP, axis=-1)
    rotated = hadamard32(x).astype(np.float64)
    # half a step, and for the tiniest groups the float16 subnormals' spacing (2^-24) times 127;
    # the rotation's own rounding (five float32 additions) is far below a step
    slack = 4 * 2.0**-24 * np.abs(rotated) + 127 * 2.0**-25
    assert (np.abs(back - rotated) <= 0.5 * step * (1 + 2.0**-9) + slack).all()
    assert (np.abs(q) <= 127).all()
    zero_groups = np.all(x.reshape(rows, 2, groups, INT8_GROUP) == 0, axis=-1)
    assert (back.reshape(rows, 2, groups, INT8_GROUP)[zero_groups] == 0).all()
    assert np.allclose(hadamard32(back, 1 / INT8_GROUP), x, rtol=0, atol=float(step.max()) + 127 * 2.0**-25)


@settings(max_examples=50, deadline=None)
@given(groups=st.integers(1, 12), scale=st.sampled_from([1.0, 1 / 32, 0.5]), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_hadamard_rotation_is_numpys_and_its_own_inverse(groups: int, scale: float, seed: int) -> None:
    x = (np.random.default_rng(seed).standard_normal(groups * INT8_GROUP) * 10).astype(np.float32)
    y = x.copy()
    compiled.hadamard32_(y, scale)
    assert np.array_equal(y, hadamard32(x, scale))
    h = hadamard32(np.eye(INT8_GROUP, dtype=np.float32))
    assert set(np.unique(h)) == {-1.0, 1.0} and np.array_equal(h @ h, INT8_GROUP * np.eye(INT8_GROUP))
    np.testing.assert_allclose(hadamard32(hadamard32(x), 1 / INT8_GROUP), x, rtol=0, atol=1e-4 * 10)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(finite_or_not, min_size=1, max_size=96),
       kv_dtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_writer_stores_what_numpy_stores(values: list[float], kv_dtype: str, seed: int) -> None:
    """float32, float16 and bfloat16 rows written by the compiled writer from a strided view (the
    projections' output) hold what to_storage gives (NaN as NaN), at their slots only."""
    rng = np.random.default_rng(seed)
    rows = 3
    wide = rng.standard_normal((rows, 5, 32)).astype(np.float32)            # [T, heads, hd]: K is heads 1..2
    flat = wide[:, 1:3].reshape(-1)
    flat[: len(values)] = np.array(values[: flat.size], dtype=np.float32)
    wide[:, 1:3] = flat.reshape(rows, 2, 32)
    x = wide[:, 1:3]
    storage = np.dtype(storage_dtype(kv_dtype))
    cache = np.zeros((4, 2, 2, 32), dtype=storage)
    slots = rng.permutation(8)[:rows].astype(np.int64)
    compiled.kv_store(x, slots, cache)
    with np.errstate(over="ignore", invalid="ignore"):
        want = to_storage(np.ascontiguousarray(x), storage)
    got = cache.reshape(8, 2, 32)[slots]
    if kv_dtype == "float16":
        assert np.array_equal(got, want, equal_nan=True)
    else:
        assert np.array_equal(to_float32(got), to_float32(want), equal_nan=True)
    assert not cache.reshape(8, 2, 32)[np.setdiff1d(np.arange(8), slots)].any()


def test_an_int8_cache_needs_heads_in_groups_of_32(tmp_path: Path) -> None:
    config = LlamaModel.load(write_tiny_llama(tmp_path / "m.gguf")).config     # heads of 8
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(config, 4, 4, "int8")


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
def test_bytes_per_token_by_kv_dtype(tmp_path: Path, kv_dtype: str) -> None:
    config = LlamaModel.load(write_tiny_llama(tmp_path / "m.gguf", hidden=64, heads=2)).config   # heads of 32
    per_token = KVCache.bytes_per_block(config, 1, kv_dtype)
    itemsize = {"float32": 4, "int8": 1 + 2 / INT8_GROUP}.get(kv_dtype, 2)   # int8: its float16 scales too
    assert per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize
    kv = KVCache(config, 3, 4, kv_dtype)
    held = [a.nbytes for a in (kv.k, kv.v, kv.k_scales, kv.v_scales) if a is not None]
    assert sum(held) == 12 * per_token


# Run in a fresh interpreter: in a long one (the test session) the allocator may hand the cache
# memory that earlier tests already made resident, and there would be nothing left to commit.
COMMIT_PROBE = """
import sys
from types import SimpleNamespace
from forge.models.llama.kv_cache import KVCache
from forge.models.llama.linear import MatmulPool

def rss_anon_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

dtype, threads = sys.argv[1], int(sys.argv[2])
config = SimpleNamespace(num_layers=4, num_kv_heads=3, head_dim=64)
kv = KVCache(config, (96 << 20) // KVCache.bytes_per_block(config, 16, dtype), 16, dtype)     # ~96 MiB
before = rss_anon_kib()
pool = MatmulPool("split", threads)
kv.commit_memory(pool.run_parts if threads > 1 else None)
pool.close()
arrays = [a for a in (kv.k, kv.v, kv.k_scales, kv.v_scales) if a is not None]
print(before, rss_anon_kib(), sum(a.nbytes for a in arrays), int(any(a.any() for a in arrays)))
"""


@pytest.mark.parametrize(("kv_dtype", "threads"), [("float32", 1), ("float16", 2), ("int8", 2)])
def test_committing_the_kv_cache_takes_its_memory_and_keeps_it_zero(kv_dtype: str, threads: int) -> None:
    """Pages no one has written are not resident; after commit_memory every page of K and V is."""
    done = subprocess.run([sys.executable, "-c", COMMIT_PROBE, kv_dtype, str(threads)], capture_output=True,
                          text=True, timeout=120, check=True)
    before_kib, after_kib, nbytes, nonzero = (int(v) for v in done.stdout.split())
    assert (after_kib - before_kib) * 1024 >= 0.9 * nbytes, done.stdout     # it was not resident before
    assert nonzero == 0


def stored_kv(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray | None]:
    """float32 K or V [..., hd] as a cache of kv_dtype holds it: (values, the int8 scales or None)."""
    if kv_dtype == "int8":
        return quantize_int8(x)
    return to_storage(x, np.dtype(storage_dtype(kv_dtype))), None


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       kv_dtype=st.sampled_from(["float16", "bfloat16", "int8"]), block_size=st.sampled_from([1, 4, 16]),
       head_dim=st.sampled_from([32, 64, 128]), softcap=st.sampled_from([0.0, 0.0, 2.0]),
       seed=st.integers(0, 2**32 - 1))
def test_fused_decode_attention_reads_stored_types_like_the_numpy_path(
        lens: list[int], kv_dtype: str, block_size: int, head_dim: int, softcap: float, seed: int) -> None:
    """Both paths read the same stored values, widen them exactly (int8 by its scales) and compute
    in float32 (heads of 64 with groups of 3, 128 with groups of 1: the kernel's paths with the
    outputs in registers; soft-capped scores: its one-key-at-a-time path), on the engine's pool
    and on the compiled products' threads alike."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    batch = paged_batch(rng, lens, [1] * len(lens), block_size, num_blocks)
    num_heads = 2 if head_dim == 128 else 6
    config = SimpleNamespace(num_heads=num_heads, num_kv_heads=2, head_dim=head_dim)
    k, k_scales = stored_kv((rng.standard_normal((num_blocks, block_size, 2, head_dim)) * 3).astype(np.float32),
                            kv_dtype)
    v, v_scales = stored_kv(rng.standard_normal((num_blocks, block_size, 2, head_dim)).astype(np.float32), kv_dtype)
    scales = None if k_scales is None or v_scales is None else (k_scales, v_scales)
    q = (rng.standard_normal((batch.num_tokens, num_heads, head_dim)) / 4).astype(np.float32)
    want = attend(plan_attention(batch, config, block_size, 2, softcap=softcap), q, k, v, scales=scales)
    fused_plan = plan_attention(batch, config, block_size, 2, fused=True, softcap=softcap)
    got = attend(fused_plan, q, k, v, scales=scales)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    assert_the_pool_gives_the_same(batch, config, block_size, 2, 0, softcap, q, k, v, fused_plan, got, scales)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(1, 80), min_size=1, max_size=5), kv_heads=st.sampled_from([3, 8, 12, 32]),
       group=st.sampled_from([1, 3, 4]), kv_dtype=st.sampled_from(KV_CACHE_DTYPES),
       block_size=st.sampled_from([1, 4, 16]),
       head_dim=st.sampled_from([32, 64, 128]), window=st.sampled_from([0, 5, 40]), num_parts=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_many_heads_position_by_position_give_head_by_heads_bits(
        lens: list[int], kv_heads: int, group: int, kv_dtype: str, block_size: int, head_dim: int, window: int,
        num_parts: int, seed: int) -> None:
    """Rows of many query heads (MHA, or GQA as the default model's 3 KV heads of 3, or of 4) read position by
    position, every head of 16 keys at a time, give the bits of reading each KV head over all its keys in
    turn, on every stored type, split over parts or on the compiled products' threads (whose split may
    cut a sequence's heads)."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    batch = paged_batch(rng, lens, [1] * len(lens), block_size, num_blocks)
    config = SimpleNamespace(num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, k_scales = stored_kv((rng.standard_normal(shape) * 3).astype(np.float32), kv_dtype)
    v, v_scales = stored_kv(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    scales = None if k_scales is None or v_scales is None else (k_scales, v_scales)
    q = (rng.standard_normal((batch.num_tokens, kv_heads * group, head_dim)) / 4).astype(np.float32)
    products.pool_threads(2)
    outs = []
    for threshold in (8, 1 << 40):
        before = compiled.decode_by_position(threshold)
        try:
            for on_pool in (False, True):
                plan = plan_attention(batch, config, block_size, num_parts, fused=True, window=window,
                                      decode_on_pool=on_pool)
                outs.append(attend(plan, q, k, v, scales=scales))
        finally:
            compiled.decode_by_position(before)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    want = attend(plan_attention(batch, config, block_size, num_parts, window=window), q, k, v, scales=scales)
    assert np.max(np.abs(outs[0] - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))


@pytest.mark.parametrize("kv_dtype", KV_CACHE_DTYPES)
def test_decode_attention_built_without_avx512_reads_every_stored_type_alike(kv_dtype: str) -> None:
    """The code an AVX2 CPU gets (one key at a time, rows widened by plain loops) gives the native
    build's outputs on every storage type."""
    rng = np.random.default_rng(3)
    lens, block_size, head_dim = [1, 17, 40, 33], 4, 64
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    batch = paged_batch(rng, lens, [1] * len(lens), block_size, num_blocks)
    k, k_scales = stored_kv(rng.standard_normal((num_blocks, block_size, 2, head_dim)).astype(np.float32), kv_dtype)
    v, v_scales = stored_kv(rng.standard_normal((num_blocks, block_size, 2, head_dim)).astype(np.float32), kv_dtype)
    scales = None if k_scales is None or v_scales is None else (k_scales, v_scales)
    q = (rng.standard_normal((batch.num_tokens, 6, head_dim)) / 4).astype(np.float32)
    outs = []
    for isa in ("native", "avx2"):
        out = np.zeros_like(q)
        compiled.paged_decode_attention(q, k, v, batch.query_start[:-1].copy(), batch.block_tables, batch.context_lens,
                                        np.empty(3 * max(lens), np.float32), out, scales=scales,
                                        lib=compiled.library_at(isa))
        outs.append(out)
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=0)


def prefill_kernel_here(head_dim: int = 64) -> bool:
    """Whether the compiled prefill attention runs here (AVX-512). Where it cannot, the plan must
    keep numpy for prompt chunks."""
    if prefill_kernel.prefill_attention_supports(head_dim):
        return True
    batch = paged_batch(np.random.default_rng(0), [20], [20], 4, 6)
    config = SimpleNamespace(num_heads=2, num_kv_heads=1, head_dim=head_dim)
    assert not plan_attention(batch, config, 4, 1, fused=True).fused_prefill
    return False


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(2, 300), min_size=1, max_size=6), cached=st.floats(0.0, 0.99),
       kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([16, 48, 64]),
       block_size=st.sampled_from([1, 4, 16]), num_parts=st.integers(1, 3), window=st.sampled_from([0, 1, 5, 40, 200]),
       kv_dtype=st.sampled_from(KV_CACHE_DTYPES), seed=st.integers(0, 2**32 - 1))
def test_fused_prefill_attention_equals_the_numpy_reference(
        lens: list[int], cached: float, kv_heads: int, group: int, head_dim: int, block_size: int, num_parts: int,
        window: int, kv_dtype: str, seed: int) -> None:
    """Chunks through the compiled kernels (whole prompts, chunks after a cached prefix, a decode
    row with its guesses: short ones on the decode kernel, the rest on the prefill kernel; blocks
    scattered, tiles dealt over parts, a sliding window or none, every K/V storage type) give the
    numpy path's output."""
    if kv_dtype == "int8" and head_dim % INT8_GROUP:
        head_dim = 2 * INT8_GROUP * (head_dim // (2 * INT8_GROUP) or 1)     # int8 heads come in groups of 32
    if not prefill_kernel_here(head_dim):
        return
    rng = np.random.default_rng(seed)
    query_lens = [max(2, n - int(n * cached)) for n in lens]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    batch = paged_batch(rng, lens, query_lens, block_size, num_blocks)
    config = SimpleNamespace(num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)
    k, k_scales = stored_kv((rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)) * 2).astype(np.float32),
                            kv_dtype)
    v, v_scales = stored_kv(rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32),
                            kv_dtype)
    scales = None if k_scales is None or v_scales is None else (k_scales, v_scales)
    q = (rng.standard_normal((batch.num_tokens, kv_heads * group, head_dim)) / 2).astype(np.float32)
    want = attend(plan_attention(batch, config, block_size, num_parts, window=window), q, k, v, scales=scales)
    fused_plan = plan_attention(batch, config, block_size, num_parts, fused=True, window=window)
    from forge.models.llama.attention_plan import MAX_DECODE_KERNEL_ROWS
    long_rows = sum(n for n in query_lens if n > MAX_DECODE_KERNEL_ROWS)
    assert fused_plan.fused_prefill
    assert sum(t.hi - t.lo for part in fused_plan.prefill_parts for p in part for t in p.tiles) == long_rows
    assert all(t.bias is None for part in fused_plan.prefill_parts for p in part for t in p.tiles)
    got = attend(fused_plan, q, k, v, scales=scales)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, float(np.max(np.abs(want))))
    assert_the_pool_gives_the_same(batch, config, block_size, num_parts, window, 0.0, q, k, v, fused_plan, got,
                                   scales)


@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(4, 300), min_size=1, max_size=4), cached=st.floats(0.0, 0.99),
       kv_heads=st.sampled_from([1, 3]), group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([16, 48, 64]),
       block_size=st.sampled_from([1, 16]), num_parts=st.integers(1, 2), window=st.sampled_from([0, 40]),
       kv_dtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=st.integers(0, 2**32 - 1))
def test_fast_prefill_attention_is_the_attention_of_the_bfloat16_values(
        lens: list[int], cached: float, kv_heads: int, group: int, head_dim: int, block_size: int, num_parts: int,
        window: int, kv_dtype: str, seed: int) -> None:
    """In the `fast` numerics (AVX-512 BF16) the prefill kernel multiplies queries, keys, weights and
    values rounded to bfloat16: its output is the exact attention of the rounded queries, keys and
    values within the rounding of the weights (2^-8 of the largest value). Without BF16 it is the
    float32 kernel's output."""
    if not prefill_kernel_here(head_dim):
        return
    rng = np.random.default_rng(seed)
    query_lens = [max(4, n - int(n * cached)) for n in lens]        # chunks the prefill kernel takes
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    batch = paged_batch(rng, lens, query_lens, block_size, num_blocks)
    config = SimpleNamespace(num_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k, _ = stored_kv((rng.standard_normal(shape) * 2).astype(np.float32), kv_dtype)
    v, _ = stored_kv(rng.standard_normal(shape).astype(np.float32), kv_dtype)
    q = (rng.standard_normal((batch.num_tokens, kv_heads * group, head_dim)) / 2).astype(np.float32)
    plan = plan_attention(batch, config, block_size, num_parts, fused=True, window=window)
    got = attend(plan, q, k, v, fast=True)
    if products.qmatmul_fast_kind(compiled.library_at("native")) not in ("bfloat16", "int8+bfloat16"):
        np.testing.assert_array_equal(got, attend(plan, q, k, v))
        return
    def bf16(a: npt.NDArray[np.generic]) -> npt.NDArray[np.float32]:     # the cache's own bfloat16 rounding
        return to_float32(to_storage(to_float32(a), np.dtype(storage_dtype("bfloat16"))))

    want = attend(plan_attention(batch, config, block_size, num_parts, window=window), bf16(q), bf16(k), bf16(v))
    prompt_rows = np.concatenate([np.arange(t.lo, t.hi) for part in plan.prefill_parts for p in part for t in p.tiles])
    vmax = float(np.max(np.abs(to_float32(v))))
    assert np.max(np.abs(got[prompt_rows] - want[prompt_rows])) <= 2.0**-8 * vmax + 1e-5


def test_prompt_chunks_the_prefill_kernel_does_not_take_stay_on_numpy() -> None:
    """Soft-capped scores (Gemma 2) and heads wider than 64 keep the numpy path, masks built."""
    batch = paged_batch(np.random.default_rng(1), [40], [40], 16, 4)
    for head_dim, softcap in ((64, 50.0), (80, 0.0), (256, 0.0)):
        config = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=head_dim)
        plan = plan_attention(batch, config, 16, 1, fused=True, softcap=softcap)
        assert not plan.fused_prefill
        assert all(t.bias is not None for part in plan.prefill_parts for p in part for t in p.tiles)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 200), width=st.sampled_from([16, 64, 576, 1000]), stride=st.integers(0, 40),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**32 - 1))
def test_the_compiled_norm_and_silu_equal_numpy(rows: int, width: int, stride: int, scale: float, seed: int) -> None:
    """RMSNorm (of a row range of a wider array too, as the forward passes views) and the gated
    SiLU agree with the numpy reference to float32 rounding."""
    from forge.models.llama import llama_model as model_mod
    rng = np.random.default_rng(seed)
    wide = (rng.standard_normal((rows, width + stride)) * scale).astype(np.float32)
    x, weight = wide[:, :width], rng.standard_normal(width).astype(np.float32)
    gate_up = (rng.standard_normal((rows, 2 * width)) * 4 * scale).astype(np.float32)
    gate_up[0, :3] = [-200.0, 200.0, 0.0]                  # exp(-gate) overflowing, and the other end
    want_norm, want_act = model_mod.rms_norm(x, weight, 1e-6), model_mod.swiglu(gate_up)
    got_norm, got_act = model_mod.rms_norm_compiled(x, weight, 1e-6), model_mod.swiglu_compiled(gate_up)
    np.testing.assert_allclose(got_norm, want_norm, rtol=2e-6, atol=1e-6 * float(np.abs(want_norm).max()))
    np.testing.assert_allclose(got_act, want_act, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("env", [{"FORGE_NO_COMPILED_KERNELS": "1"}, {"CC": "/nonexistent/cc"}])
def test_without_the_compiled_kernels_forge_says_why_and_runs_numpy_attention(
        tmp_path: Path, env: dict[str, str]) -> None:
    """No compiler (or one that fails): the model still loads, on the numpy attention, and the
    status says why (for the ready line). A fresh process: the library is built once per process."""
    model = write_tiny_llama(tmp_path / "m.gguf", quant="Q4_0", hidden=64, heads=4, kv_heads=2, ffn=128)
    code = ("import sys; from forge.kernels import choose_kernels, compiled; "
            "from forge.models.llama.llama_model import LlamaModel;"
            f"m = LlamaModel.load({str(model)!r}, choose_kernels('onnxruntime'));"
            "print(m.compiled_ops, compiled.status()); m.forward_context([3, 4, 5])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "FORGE_HOME": str(tmp_path / "home"), **env})
    assert result.returncode == 0, result.stderr
    fused, status = result.stdout.strip().split(" ", 1)
    assert fused == "False" and status.startswith("unavailable (")


# ---- the Q8_0 head ------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), num_blocks=st.integers(1, 20),
       num_tokens=st.one_of(st.integers(1, 8), st.integers(9, 11), st.integers(12, 70)),
       num_parts=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_the_q8_kernel_multiplies_by_exactly_the_files_values(rows: int, num_blocks: int, num_tokens: int,
                                                              num_parts: int, seed: int) -> None:
    """Every tile shape of the three paths (straight from the blocks up to 8 rows of x, 4x4 tiles
    for 9-11, 32x6 column tiles from 12): rows of W and of x not multiples of a tile, one to many
    blocks, the rows split over 1-3 pool parts."""
    rng = np.random.default_rng(seed)
    cols = 32 * num_blocks
    data = random_blocks(rng, Q.Q8_0, rows, cols)
    x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
    pool, saved = MatmulPool("split", num_parts), linear_mod._active
    linear_mod._active = pool                  # the process's pool, without touching BLAS's threads
    try:
        got = Q8Matrix(data, (rows, cols)).matmul(x)
    finally:
        linear_mod._active = saved
        pool.close()
    parts = [affine_blocks(data, Q.Q8_0, (rows, cols))]
    assert_close(got, reference_product(x, parts), rel=2e-6, scale=term_magnitude(x, parts))


def test_the_q8_kernel_built_without_avx512_gives_the_same_products(tmp_path: Path) -> None:
    """The head kernel as a CPU without AVX-512 gets it (x86-64-v3: AVX2, FMA, F16C; its direct and
    column paths then compute in 8-float vectors): the exact product within float32 rounding, as
    the native build gives it, at every path's row counts."""
    import ctypes
    import platform
    import shutil

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only: the other builds are the native one")
    source = Path(compiled.__file__).with_name("q8_matmul.c")
    built, obj = tmp_path / "q8_v3.so", tmp_path / "q8_v3.o"
    cc = shutil.which("cc") or "gcc"
    # Compiled and linked apart, as compiled.py builds: -ffast-math at link time would add crtfastmath.o,
    # which turns on flush-to-zero for the whole process when the library loads.
    subprocess.run([cc, *[f for f in compiled.CFLAGS if f != "-march=native"], "-march=x86-64-v3", "-c",
                    "-o", str(obj), str(source)], check=True)
    subprocess.run([cc, *compiled.LDFLAGS, "-o", str(built), str(obj), "-lm"], check=True)
    lib = ctypes.CDLL(str(built))
    rng = np.random.default_rng(5)
    rows, cols = 37, 32 * 6
    data = random_blocks(rng, Q.Q8_0, rows, cols)
    parts = [affine_blocks(data, Q.Q8_0, (rows, cols))]
    for num_tokens in (1, 3, 8, 9, 12, 33):
        x = rng.standard_normal((num_tokens, cols)).astype(np.float32)
        native = np.empty((num_tokens, rows), np.float32)
        products.q8_0_matmul(x, data, native, 0, rows)
        got = np.empty_like(native)
        rc = lib.q8_0_matmul(ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(num_tokens), ctypes.c_int64(cols),
                             ctypes.c_void_p(data.ctypes.data), ctypes.c_int64(0), ctypes.c_int64(rows),
                             ctypes.c_int64(rows), ctypes.c_void_p(got.ctypes.data))
        assert rc == 0
        for product in (native, got):          # both builds within float32 rounding of the exact product
            assert_close(product, reference_product(x, parts), rel=2e-6, scale=term_magnitude(x, parts))


def test_a_tied_q8_head_shares_the_embeddings_blocks(default_model_path: Path) -> None:
    """The default model: its head is the embedding's own Q8_0 bytes, not a second copy."""
    model = LlamaModel.load(default_model_path, choose_kernels("onnxruntime"))
    w = model.weights
    assert isinstance(w.head, Q8Matrix) and isinstance(w.embedding, QuantEmbedding)
    assert np.shares_memory(w.head._blocks, w.embedding.data) and w.head.shape == (576, 49152)
    gguf_bytes = default_model_path.stat().st_size
    assert w.nbytes < 1.15 * gguf_bytes        # the weights as held: close to the file's size
