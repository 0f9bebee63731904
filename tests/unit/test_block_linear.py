"""The blocks backend's product (forge/kernels/qmatmul.c) against the numpy reference
(forge.kernels.quant_blocks' dequantize(), then a float64 product), for every type it reads, at every
instruction-set level this host can run; and batch invariance: a row's result is the same bits
whatever else the step holds."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.kernels import compiled, products
from forge.kernels.quant_blocks import affine_blocks
from forge.kernels.quant_linear import BlockMatrix, as_blocks

Q = GGMLQuantizationType
QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS,
             Q.MXFP4]
PLAIN = [Q.F32, Q.F16, Q.BF16]
# Byte offsets of each block's float16 scales: random bytes there could be inf or NaN. MXFP4's one
# scale byte (an E8M0 exponent, byte 0) is drawn apart: 2^-10 .. 2^-3.
F16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0], Q.IQ4_XS: [0], Q.MXFP4: []}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
# The levels this host can run (each is still built by test_every_level_builds).
RUNNABLE = ["native", "baseline"] + (["avx512", "avx2"] if {"avx2", "fma"} <= FLAGS and "avx512f" in FLAGS else [])
# Each level's fast numerics on this host: bfloat16 products where the build has AVX-512 BF16
# (native takes the AMX tiles for big steps where the host has them, avx512 never does), with the
# K-quants' int8 products beside them where it also has AVX-512 BW and VNNI; int8 activations where
# it has AVX2 and no AVX-512; none in the baseline build (or AVX-512 without BF16).
AVX2 = {"avx2", "fma"} <= FLAGS
WIDE_KIND = ("int8+bfloat16" if {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"} <= FLAGS
             else "bfloat16" if {"avx512f", "avx512_bf16"} <= FLAGS else "" if "avx512f" in FLAGS
             else "int8" if AVX2 else "")
FAST_KINDS = {"native": WIDE_KIND, "avx512": WIDE_KIND, "avx2": "int8" if AVX2 else "", "baseline": ""}
# The levels whose fast numerics the tests check here (native alone where it has none: refused).
FAST_LEVELS = [isa for isa in RUNNABLE if FAST_KINDS[isa]] or ["native"]
# The types the int8 numerics take as integer products, x per block of 32 in steps of up to
# int8_rows rows (the table types through their int8 values); the others take the float32 path.
INT8_TYPES = {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4}
# The K-quants: x per superblock of 256 (llama.cpp's Q8_K), in every step.
INT8_K_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}


def random_matrix(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, k: int) -> tuple[
        npt.NDArray[np.uint8], npt.NDArray[np.float32]]:
    """Random blocks [rows, bytes] of qtype and the float32 matrix they mean (the reference)."""
    if qtype in PLAIN:
        w = rng.standard_normal((rows, k)).astype(np.float32)
        if qtype == Q.F16:
            data = w.astype(np.float16)
            return as_blocks(data, rows), data.astype(np.float32)
        if qtype == Q.BF16:
            bits = (w.view(np.uint32) >> 16).astype(np.uint16)
            return as_blocks(bits, rows), (bits.astype(np.uint32) << 16).view(np.float32)
        return as_blocks(w, rows), w
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    n = rows * k // elems
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for off in F16_AT[qtype]:
        blocks[:, off:off + 2] = rng.uniform(0.001, 0.05, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(118, 126, n)
    data = blocks.reshape(rows, -1)
    return data, affine_blocks(data, qtype, (rows, k)).dequantize()


def product(lib: ctypes.CDLL, x: npt.NDArray[np.float32], parts: list[tuple[npt.NDArray[np.uint8], int]],
            k: int) -> npt.NDArray[np.float32]:
    out = np.empty((x.shape[0], sum(p.shape[0] for p, _ in parts)), dtype=np.float32)
    products.qmatmul(np.ascontiguousarray(x), k, products.qparts(parts), out, lib=lib)
    return out


def assert_matches_reference(got: npt.NDArray[np.float32], x: npt.NDArray[np.float32],
                             w: npt.NDArray[np.float32]) -> None:
    """Within float32 accumulation's error of the float64 product: relative to the sum of the
    terms' magnitudes (what the rounding scales with), 1e-5 covers K up to thousands."""
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64) + 1e-30
    assert np.all(np.abs(got - want) / scale < 1e-5)


@pytest.fixture(scope="module", params=RUNNABLE)
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    built = compiled.library_at(request.param)
    products.pool_threads(2, lib=built)
    return built


@settings(max_examples=25, deadline=None)
@given(qtypes=st.lists(st.sampled_from(QUANTIZED + PLAIN), min_size=1, max_size=3),
       rows=st.lists(st.integers(1, 23), min_size=3, max_size=3),
       blocks_along_k=st.integers(1, 3), num_x=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_the_product_matches_the_reference_for_every_type(lib: ctypes.CDLL, qtypes: list[GGMLQuantizationType],
                                                           rows: list[int], blocks_along_k: int, num_x: int,
                                                           seed: int) -> None:
    """Parts of mixed types stacked (as q/k/v are), odd row counts, K of 1-3 super-blocks, and
    step sizes across the fused (1-16 rows) and tiled (17+, tiles of 64) paths."""
    rng = np.random.default_rng(seed)
    k = 256 * blocks_along_k
    made = [random_matrix(rng, qtype, n, k) for qtype, n in zip(qtypes, rows, strict=False)]
    x = rng.standard_normal((num_x, k)).astype(np.float32)
    got = product(lib, x, [(blocks, int(qtype)) for (blocks, _), qtype in zip(made, qtypes, strict=False)], k)
    assert_matches_reference(got, x, np.concatenate([w for _, w in made]))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4, *PLAIN],
                         ids=lambda q: q.name)
def test_k_of_whole_32_blocks_that_are_not_whole_chunks(lib: ctypes.CDLL, qtype: GGMLQuantizationType) -> None:
    """K = 576 (the default model's width) and 32: chunks of 256 with a partial last one."""
    rng = np.random.default_rng(3)
    for k in (32, 576):
        blocks, w = random_matrix(rng, qtype, 9, k)
        x = rng.standard_normal((5, k)).astype(np.float32)
        assert_matches_reference(product(lib, x, [(blocks, int(qtype))], k), x, w)


@pytest.mark.parametrize("qtype", QUANTIZED + PLAIN, ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_the_rest_of_the_step(lib: ctypes.CDLL, qtype: GGMLQuantizationType) -> None:
    """Batch invariance: row r of a step of T rows equals, bit for bit, the same row computed
    alone, for T on both paths and past a tile of 64."""
    rng = np.random.default_rng(int(qtype))
    blocks, _ = random_matrix(rng, qtype, 37, 512)
    x = rng.standard_normal((150, 512)).astype(np.float32)
    alone = np.concatenate([product(lib, x[r:r + 1], [(blocks, int(qtype))], 512) for r in range(0, 150, 7)])
    for num_rows in (3, 16, 17, 64, 150):
        step = product(lib, x[:num_rows], [(blocks, int(qtype))], 512)
        picked = list(range(0, num_rows, 7))
        np.testing.assert_array_equal(step[picked], alone[:len(picked)])


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K], ids=lambda q: q.name)
def test_wide_rows_take_the_tiled_path_from_5_rows_with_the_same_bits(lib: ctypes.CDLL,
                                                                      qtype: GGMLQuantizationType) -> None:
    """Where K is 2,048 or more, steps of 5-16 rows go through the tiled path (qmatmul.h's WIDE_K): each
    row still equals, bit for bit, the row computed alone on the fused path, and the numpy reference."""
    rng = np.random.default_rng(7 + int(qtype))
    blocks, w = random_matrix(rng, qtype, 9, 2048)
    x = rng.standard_normal((16, 2048)).astype(np.float32)
    alone = np.concatenate([product(lib, x[r:r + 1], [(blocks, int(qtype))], 2048) for r in range(16)])
    for num_rows in (4, 5, 8, 16):
        np.testing.assert_array_equal(product(lib, x[:num_rows], [(blocks, int(qtype))], 2048), alone[:num_rows])
    np.testing.assert_allclose(alone, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-3, atol=2e-3)


def test_one_thread_and_two_give_the_same_bits() -> None:
    rng = np.random.default_rng(5)
    blocks, _ = random_matrix(rng, Q.Q4_K, 100, 512)
    x = rng.standard_normal((9, 512)).astype(np.float32)
    lib = compiled.library_at("native")
    products.pool_threads(1, lib=lib)
    one = product(lib, x, [(blocks, int(Q.Q4_K))], 512)
    products.pool_threads(2, lib=lib)
    np.testing.assert_array_equal(product(lib, x, [(blocks, int(Q.Q4_K))], 512), one)
    if FAST:                                      # the fast numerics too, the AMX tiles' steps included
        x = rng.standard_normal((70, 512)).astype(np.float32)
        products.pool_threads(1, lib=lib)
        one = fast_product(x, [(blocks, int(Q.Q4_K))], 512, lib)
        products.pool_threads(2, lib=lib)
        np.testing.assert_array_equal(fast_product(x, [(blocks, int(Q.Q4_K))], 512, lib), one)


def test_every_level_builds() -> None:
    """Each level compiles here, whether or not this CPU can run it."""
    for isa in compiled.ISA_FLAGS:
        assert products.qmatmul_lanes(compiled.library_at(isa)) in (8, 16)


def test_the_levels_have_their_vector_widths() -> None:
    assert products.qmatmul_lanes(compiled.library_at("baseline")) == 8
    assert products.qmatmul_lanes(compiled.library_at("avx2")) == 8
    native = products.qmatmul_lanes(compiled.library_at("native"))
    assert native == (16 if "avx512f" in FLAGS else 8)


def test_bad_shapes_and_types_are_refused() -> None:
    rng = np.random.default_rng(1)
    blocks, _ = random_matrix(rng, Q.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="whole blocks"):
        BlockMatrix([(blocks, int(Q.Q4_K))], 128).matmul(np.zeros((1, 128), np.float32))
    with pytest.raises(ValueError, match="disagree"):
        BlockMatrix([(blocks, int(Q.Q4_K))], 256).matmul(np.zeros((1, 255), np.float32))
    with pytest.raises(ValueError, match="type it reads"):
        products.qparts([(blocks, int(Q.IQ2_XXS))])


def test_the_block_matrix_multiplies_and_looks_rows_up() -> None:
    rng = np.random.default_rng(2)
    blocks, w = random_matrix(rng, Q.Q6_K, 12, 512)
    matrix = BlockMatrix([(blocks, int(Q.Q6_K))], 512)
    assert matrix.shape == (512, 12) and matrix.nbytes == blocks.nbytes and matrix.reads(blocks)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    assert_matches_reference(matrix.matmul(x), x, w)
    np.testing.assert_allclose(matrix.rows(np.array([3, 0, 11])), w[[3, 0, 11]], rtol=1e-6, atol=1e-7)


def _mapped(array: npt.NDArray[np.generic]) -> bool:
    """Whether array is a view (however deep) of a file mapping."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = base.base  # type: ignore[assignment]
    return isinstance(base, np.memmap)


def test_the_default_model_is_multiplied_from_its_files_pages(default_model_path: Path) -> None:
    """Weights once in memory: every matrix (and the tied head) reads the file's mapping in place,
    no copy; what the weights hold is at most the file's size."""
    from forge.kernels import choose_kernels
    from forge.models.llama.llama_model import LlamaModel

    model = LlamaModel.load(default_model_path, choose_kernels("blocks"))
    w = model.weights
    matrices = [m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)] + [w.head]
    assert all(isinstance(m, BlockMatrix) for m in matrices)
    assert all(_mapped(blocks) for m in matrices for blocks, _ in m._parts)  # type: ignore[union-attr]
    assert w.nbytes <= default_model_path.stat().st_size
    assert model.forward_context([1, 504, 3458, 282]).shape == (model.vocab_size,)


# ---- the fast numerics: bfloat16 products (AVX-512 BF16), int8 activations (AVX2) ---------------

FAST = products.qmatmul_fast(compiled.library_at("native"))


def bf16_round(a: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """float32 values rounded to the nearest bfloat16 (ties to even), as VCVTNE2PS2BF16 does."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def int8_round(a: npt.NDArray[np.float32], block: int = 32) -> npt.NDArray[np.float32]:
    """Rows of x as the int8 numerics see them: per block of 32 (or 256) values, codes round(x * (127 /
    max|x|)) (ties to even) times the scale max|x| / 127, in float32 as qmatmul_int8.c computes them."""
    rows, k = a.shape
    blocks = np.ascontiguousarray(a, dtype=np.float32).reshape(rows, k // block, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(blocks * inverse), -127, 127)
    return (codes * (amax / np.float32(127))).astype(np.float32).reshape(rows, k)


@pytest.fixture(scope="module", params=FAST_LEVELS)
def fast_lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    built = compiled.library_at(request.param)
    products.pool_threads(2, lib=built)
    return built


def fast_product(x: npt.NDArray[np.float32], parts: list[tuple[npt.NDArray[np.uint8], int]],
                 k: int, lib: ctypes.CDLL | None = None) -> npt.NDArray[np.float32]:
    out = np.empty((x.shape[0], sum(p.shape[0] for p, _ in parts)), dtype=np.float32)
    products.qmatmul(np.ascontiguousarray(x), k, products.qparts(parts), out, lib=lib or compiled.library_at("native"),
                     fast=True)
    return out


@settings(max_examples=25, deadline=None)
@given(qtypes=st.lists(st.sampled_from(QUANTIZED + PLAIN), min_size=1, max_size=3),
       rows=st.lists(st.integers(1, 40), min_size=3, max_size=3),
       blocks_along_k=st.integers(1, 3), num_x=st.integers(1, 80), seed=st.integers(0, 2**32 - 1))
def test_fast_numerics_are_the_product_of_the_rounded_values(
        fast_lib: ctypes.CDLL, qtypes: list[GGMLQuantizationType], rows: list[int], blocks_along_k: int, num_x: int,
        seed: int) -> None:
    """bfloat16: x and every widened weight rounded to bfloat16, their products exact, summed in
    float32: within float32 accumulation's error of that product in float64, on every path (fused,
    tiled, and the AMX tiles from 8 rows where the host has them; parts of up to 40 rows cross the
    tiles' groups of 32). With the tiles, steps of fewer rows are the float32 reference's product.
    int8: the K-quants in every step (with AVX-512: in steps of up to int8_k_rows rows, bigger ones
    bfloat16's, as every other type), x's int8 codes per superblock of 256 times their scales against
    the exact weights; Q4_0, Q4_1 and Q8_0 the same per block of 32 in steps of up to int8_rows rows,
    bigger steps (prefill) and the other types the float32 reference's product. Where the build has
    no fast numerics, asking for them is refused instead."""
    rng = np.random.default_rng(seed)
    k = 256 * blocks_along_k
    made = [random_matrix(rng, qtype, n, k) for qtype, n in zip(qtypes, rows, strict=False)]
    parts = [(blocks, int(qtype)) for (blocks, _), qtype in zip(made, qtypes, strict=False)]
    x = rng.standard_normal((num_x, k)).astype(np.float32)
    if not FAST:
        with pytest.raises(ValueError, match="no fast numerics"):
            fast_product(x, parts, k, fast_lib)
        return
    got = fast_product(x, parts, k, fast_lib)
    kind = products.qmatmul_fast_kind(fast_lib)
    if kind == "int8+bfloat16" and not products.qmatmul_amx_rows(fast_lib):   # with the tiles: as bfloat16 below
        col = 0
        for qtype, (_, w) in zip(qtypes, made, strict=False):
            if qtype in INT8_K_TYPES and num_x <= products.qmatmul_int8_k_rows(fast_lib):
                assert_matches_reference(got[:, col:col + w.shape[0]], int8_round(x, 256), w)
            else:
                assert_matches_reference(got[:, col:col + w.shape[0]], bf16_round(x), bf16_round(w))
            col += w.shape[0]
        return
    if kind == "int8":
        small = num_x <= products.qmatmul_int8_rows(fast_lib)
        col = 0
        for qtype, (_, w) in zip(qtypes, made, strict=False):
            seen = (int8_round(x, 256) if qtype in INT8_K_TYPES else int8_round(x) if qtype in INT8_TYPES and small
                    else x)
            assert_matches_reference(got[:, col:col + w.shape[0]], seen, w)
            col += w.shape[0]
        return
    w = np.concatenate([w for _, w in made])
    if num_x < products.qmatmul_amx_rows(fast_lib):   # with the tiles, small steps are float32's
        assert_matches_reference(got, x, w)
    else:
        assert_matches_reference(got, bf16_round(x), bf16_round(w))


@pytest.mark.parametrize("qtype", QUANTIZED + PLAIN, ids=lambda q: q.name)
def test_fast_numerics_keep_a_rows_result_independent_of_the_step(fast_lib: ctypes.CDLL,
                                                                  qtype: GGMLQuantizationType) -> None:
    """Batch invariance in the fast numerics: bfloat16 steps of up to bf16_split rows (the fused
    path) round and add in one order, bigger ones (32 weight rows in the lanes) in another, the same
    bits within each (where there is no such kernel, the fused and tiled paths add in one order).
    int8 products: the K-quants' in every step, every row quantized alone; the other types' in steps
    of up to int8_rows rows, bigger steps taking the float32 path, whose rows are each row's float32
    product alone. Int8 K-quants on AVX-512 VNNI: steps of up to
    int8_k_split rows from the blocks, bigger ones with 16 weight rows in the lanes, the same bits
    within each. The AMX tiles add in another order: where they take steps (from amx_rows rows,
    smaller ones going to the float32 path), a row's bits are the same in every step of that size or
    more, and the same in every smaller step, but differ between the two."""
    rng = np.random.default_rng(100 + int(qtype))
    blocks, _ = random_matrix(rng, qtype, 37, 512)
    x = rng.standard_normal((150, 512)).astype(np.float32)
    part = [(blocks, int(qtype))]
    if not FAST:
        with pytest.raises(ValueError, match="no fast numerics"):
            fast_product(x[:1], part, 512, fast_lib)
        return
    amx_rows = products.qmatmul_amx_rows(fast_lib)
    alone = np.concatenate([fast_product(x[r:r + 1], part, 512, fast_lib) for r in range(0, 150, 7)])
    # with the tiles, the reference for big steps: each row in a step of exactly amx_rows rows
    tiled = (np.concatenate([fast_product(np.concatenate([x[r:r + 1], x[:amx_rows - 1]]), part, 512, fast_lib)[:1]
                             for r in range(0, 150, 7)]) if amx_rows else alone)
    int8_rows = products.qmatmul_int8_rows(fast_lib)
    if int8_rows and qtype not in INT8_K_TYPES:   # bigger steps: each row's float32 product alone
        tiled = np.concatenate([product(fast_lib, x[r:r + 1], part, 512) for r in range(0, 150, 7)])
    # int8 K-quants on AVX-512 VNNI: steps of up to `split` rows from the blocks, bigger ones on the
    # lanes-as-rows kernel, whose reference is each row in a step of split + 1 rows
    split = products.qmatmul_int8_k_split(fast_lib) if qtype in INT8_K_TYPES and not amx_rows else 0
    # bfloat16 steps of more than bf16_split rows: 32 weight rows in the lanes, likewise
    if not amx_rows and not split and not (int8_rows and qtype not in INT8_K_TYPES) and (
            qtype not in INT8_K_TYPES or not products.qmatmul_int8_k_rows(fast_lib)):
        split = products.qmatmul_bf16_split(fast_lib)
    if split:
        tiled = np.concatenate([fast_product(np.concatenate([x[r:r + 1], x[:split]]), part, 512, fast_lib)[:1]
                                for r in range(0, 150, 7)])
    for num_rows in (3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 150):
        step = fast_product(x[:num_rows], part, 512, fast_lib)
        picked = list(range(0, num_rows, 7))
        want = (tiled if (amx_rows and num_rows >= amx_rows) or (int8_rows and num_rows > int8_rows)
                or (split and num_rows > split) else alone)
        np.testing.assert_array_equal(step[picked], want[:len(picked)])


def test_the_tiles_are_the_native_levels_alone() -> None:
    """Only the native build takes the AMX tiles, and only on a CPU that has them; the avx512
    level is how such a host runs the path of CPUs without them."""
    assert products.qmatmul_amx_rows(compiled.library_at("avx512")) == 0
    native = products.qmatmul_amx_rows(compiled.library_at("native"))
    assert native == 0 or {"amx_tile", "amx_bf16"} <= FLAGS
    if {"amx_tile", "amx_bf16", "avx512_bf16"} <= FLAGS:
        assert native == 8


def test_int8_products_are_decode_steps_alone() -> None:
    """Q4_0's, Q4_1's and Q8_0's int8 products take steps of up to 4 rows (decode, speculative
    verification), where they beat float32; their prefill takes the float32 path (the K-quants'
    are int8 in every step). Builds without int8 products say 0."""
    for isa in compiled.ISA_FLAGS:
        want = 4 if FAST_KINDS[isa] == "int8" else 0
        assert products.qmatmul_int8_rows(compiled.library_at(isa)) == want, isa


def test_each_level_has_its_fast_numerics() -> None:
    """bfloat16 products are AVX-512 BF16 code, int8 activations AVX2 code (the 8-lane build); the
    baseline build refuses both."""
    for isa in compiled.ISA_FLAGS:
        assert products.qmatmul_fast_kind(compiled.library_at(isa)) == FAST_KINDS[isa], isa
    assert FAST == bool(WIDE_KIND)


def test_the_default_model_in_fast_numerics_stays_close_to_the_reference(default_model_path: Path) -> None:
    """The flag reaches every matrix, and the model's next-token distribution moves by the fast
    numerics' rounding only: same top token, log-probabilities of the top 20 within a tenth
    (bfloat16) or a few tenths (int8)."""
    from forge.kernels import choose_kernels
    from forge.models.llama.llama_model import LlamaModel

    if not FAST:
        with pytest.raises(ValueError, match="AVX-512 BF16"):
            choose_kernels("blocks", "fast")
        return
    fast = LlamaModel.load(default_model_path, choose_kernels("blocks", "fast"))
    reference = LlamaModel.load(default_model_path, choose_kernels("blocks"))
    w = fast.weights
    matrices = [m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)] + [w.head]
    assert all(isinstance(m, BlockMatrix) and m.fast for m in matrices)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 7045, 30, 216]   # 8+ rows: the AMX tiles' steps too
    got, want = fast.forward_context(prompt), reference.forward_context(prompt)

    def log_softmax(v: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        v64 = v.astype(np.float64)
        return v64 - v64.max() - np.log(np.exp(v64 - v64.max()).sum())

    assert int(got.argmax()) == int(want.argmax())
    top = np.argsort(want)[-20:]
    # bfloat16's rounding moves them by hundredths; int8 activations per block of 32 (llama.cpp's own
    # for these types) by up to a few tenths on this 135M model (0.17 here; onnxruntime's int8: 0.13)
    bound = 0.1 if products.qmatmul_fast_kind() in ("bfloat16", "int8+bfloat16") else 0.3
    assert np.abs(log_softmax(got)[top] - log_softmax(want)[top]).max() < bound
    assert not np.array_equal(got, want)                       # it did take the other numerics


def test_a_parked_pool_wakes_for_the_next_product() -> None:
    """pool_park sends the kernel pool's workers to sleep at once (a step parks them before Python's
    threads run); the next product wakes them, and its result is the unparked pool's, bit for bit."""
    rng = np.random.default_rng(5)
    blocks, w = random_matrix(rng, GGMLQuantizationType.Q4_K, 64, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    descriptor = products.qparts([(blocks, int(GGMLQuantizationType.Q4_K))])
    assert products.pool_threads(2) == 2
    want = np.empty((3, 64), dtype=np.float32)
    products.qmatmul(x, 512, descriptor, want)
    assert_matches_reference(want, x, w)
    for _ in range(20):
        products.pool_park()
        got = np.empty_like(want)
        products.qmatmul(x, 512, descriptor, got)
        np.testing.assert_array_equal(got, want)
