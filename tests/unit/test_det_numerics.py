"""The deterministic numerics' product (forge/kernels/qmatmul_det.c): every build level this host can run
gives exactly the bits of its definition in numpy (forge.kernels.det_reference), for every type it reads,
whatever the rows of the step, the threads, the weight rows a call takes, or the path (decode steps
straight from the blocks, bigger ones from a chunk buffer); and a model loaded in these numerics takes
them in every matrix it can, and stays with the reference's next token."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from gguf.constants import GGMLQuantizationType

from forge.kernels import choose_kernels, compiled, det_cases, det_reference, products
from forge.kernels.quant_blocks import affine_blocks
from forge.kernels.quant_linear import BlockMatrix
from tests.unit.test_block_linear import RUNNABLE
from tests.unit.test_kernels import random_blocks

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Steps on both sides of the decode path's last row count (4), the chunk path's row groups (4, or 2 for Q6_K)
# and, with the AMX tiles, a tile's 16 rows (from 8 rows on).
ROWS = [1, 3, 4, 5, 11, 17, 35]

F32 = npt.NDArray[np.float32]


def bits(a: F32) -> npt.NDArray[np.uint32]:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def det_product(x: F32, parts: list[tuple[npt.NDArray[np.uint8], int]], k: int, isa: str = "native") -> F32:
    lib = compiled.library() if isa == "native" else compiled.library_at(isa)
    out = np.empty((x.shape[0], sum(b.shape[0] for b, _ in parts)), dtype=np.float32)
    products.qmatmul_det(np.ascontiguousarray(x), k, products.qparts(parts), out, lib=lib)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_level_gives_the_definitions_bits(qtype: GGMLQuantizationType) -> None:
    """Weight rows not a multiple of 8 (or 16, 32), K of 8 superblocks, or of a few blocks of 32 (the
    decode path's tail of fewer than 8 blocks): the product equals det_reference.matmul bit for bit."""
    rng = np.random.default_rng(int(qtype))
    ks = [2048, 768] if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else [2048, 96]
    for k in ks:
        n = 37
        data = random_blocks(rng, qtype, n, k)
        x = (rng.standard_normal((max(ROWS), k)) * rng.uniform(0.01, 30, (max(ROWS), 1))).astype(np.float32)
        for rows in ROWS:
            want = det_reference.matmul(x[:rows], data, qtype, (n, k))
            for isa in RUNNABLE:
                got = det_product(x[:rows], [(data, int(qtype))], k, isa)
                assert np.array_equal(bits(got), bits(want)), f"{qtype.name} K={k} rows={rows} {isa}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_it_stays_close_to_the_exact_product(qtype: GGMLQuantizationType) -> None:
    """x as 15-bit codes: within 2e-4 of the largest output, against the float64 product of the file's values
    (8-bit codes are ~5e-3 here)."""
    rng = np.random.default_rng(40 + int(qtype))
    k, n = 1024, 24
    data = random_blocks(rng, qtype, n, k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    exact = x.astype(np.float64) @ affine_blocks(data, qtype, (n, k)).dequantize().astype(np.float64).T
    got = det_product(x, [(data, int(qtype))], k)
    assert np.abs(got - exact).max() < 2e-4 * np.abs(exact).max()


def test_a_rows_bits_do_not_depend_on_the_step_or_the_threads() -> None:
    """A row alone (decode path), among 32 others (chunk path) at any position, and on one thread or two:
    the same bits; stacked parts of different types give each part's own product."""
    rng = np.random.default_rng(7)
    k = 1536
    parts = [(random_blocks(rng, Q.Q4_K, 45, k), int(Q.Q4_K)), (random_blocks(rng, Q.Q6_K, 19, k), int(Q.Q6_K)),
             (random_blocks(rng, Q.Q8_0, 8, k), int(Q.Q8_0))]
    x = rng.standard_normal((33, k)).astype(np.float32)
    batch = det_product(x, parts, k)
    for row in (0, 16, 32):
        alone = det_product(x[row:row + 1], parts, k)
        assert np.array_equal(bits(alone[0]), bits(batch[row]))
        assert np.array_equal(bits(det_product(x[row:row + 3], parts, k)[0]), bits(batch[row]))
    col = 0
    for data, qtype in parts:
        own = det_product(x, [(data, qtype)], k)
        assert np.array_equal(bits(own), bits(batch[:, col:col + data.shape[0]]))
        col += data.shape[0]
    before = products.pool_threads(1)
    try:
        one_thread = det_product(x, parts, k)
    finally:
        products.pool_threads(before)
    assert np.array_equal(bits(one_thread), bits(batch))


def test_quantized_x_is_the_definitions() -> None:
    """x's 15-bit codes, scales and sums: as det_reference.quantize, all-zero blocks (codes 0, scale 0),
    values far from 1 (below 2^-100: zeros) and what is not finite included."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 256)).astype(np.float32) * np.float32(1e-3)
    x[1, 32:64] = 0.0
    x[2] *= np.float32(1e30)
    x[3] *= np.float32(1e-35)
    x[4, 3], x[4, 40] = np.inf, np.nan            # an infinity's block, a NaN beside finite values
    q, dx, bsum, hsum = products.det_quantize(x)
    want_q, want_dx, want_bsum, want_halves = det_reference.quantize(x)
    assert np.array_equal(q.reshape(want_q.shape), want_q)
    assert np.array_equal(bits(dx), bits(want_dx))
    assert np.array_equal(bsum, want_bsum)
    assert np.array_equal(hsum.reshape(want_halves.shape), want_halves)
    assert np.abs(q[:4]).max() == det_reference.XMAX and not q[1, 32:64].any() and dx[1, 1] == 0.0
    assert not q[3].any()


def test_q6_k_at_its_integer_bound() -> None:
    """Q6_K's largest block sum (every code 0, so -32 each, scales -128, x at full scale) fits int32: the
    product is the definition's and not an overflow's."""
    k, n = 256, 8
    block = np.zeros(210, dtype=np.uint8)
    block[192:208] = np.array([-128] * 16, dtype=np.int8).view(np.uint8)
    block[208:210] = np.array([1e-4], dtype=np.float16).view(np.uint8)
    data = np.tile(block, (n, 1))
    x = np.ones((1, k), dtype=np.float32)
    got = det_product(x, [(data, int(Q.Q6_K))], k)
    want = det_reference.matmul(x, data, Q.Q6_K, (n, k))
    assert np.array_equal(bits(got), bits(want))
    assert np.allclose(got, 256 * 32 * 128 * 1e-4, rtol=1e-3)       # every value -32 * -128 * d


def test_the_numerics_are_chosen_by_name_on_the_blocks_backend() -> None:
    for name in ("auto", "blocks"):
        chosen = choose_kernels(name, "deterministic")
        assert (chosen.backend, chosen.det_products, chosen.numerics) == ("blocks", True, "deterministic")
    for name in ("numpy", "onnxruntime", "fast", "amx"):
        with pytest.raises(ValueError, match="deterministic"):
            choose_kernels(name, "deterministic")


def test_a_model_takes_them_in_every_matrix(default_model_path: Path) -> None:
    """The default model (Q4_1 layers, a tied Q8_0 head) in the deterministic numerics: every matrix a
    deterministic BlockMatrix, the next token the reference numerics', log-probabilities of the top 20
    within a hundredth."""
    from forge.models.llama.llama_model import LlamaModel

    det = LlamaModel.load(default_model_path, choose_kernels("blocks", "deterministic"))
    reference = LlamaModel.load(default_model_path, choose_kernels("blocks"))
    w = det.weights
    matrices = [m for layer in w.layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)] + [w.head]
    assert all(isinstance(m, BlockMatrix) and m.det for m in matrices)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 7045, 30, 216]
    got, want = det.forward_context(prompt), reference.forward_context(prompt)

    def log_softmax(v: F32) -> npt.NDArray[np.float64]:
        v64 = v.astype(np.float64)
        return v64 - v64.max() - np.log(np.exp(v64 - v64.max()).sum())

    assert int(got.argmax()) == int(want.argmax())
    top = np.argsort(want)[-20:]
    assert np.abs(log_softmax(got)[top] - log_softmax(want)[top]).max() < 1e-2
    assert not np.array_equal(got, want)


def test_every_host_gives_the_committed_bits() -> None:
    """tests/data/det_expected_bits.json (scripts/reference/make_det_bits.py): the products of fixed inputs
    made without any library's random stream, hashed; this host's every level, and the numpy definition,
    give those bits, as a host of another CPU kind must."""
    expected = json.loads((Path(__file__).parents[1] / "data" / "det_expected_bits.json").read_text())["products"]
    assert set(expected) == {t.name for t in det_cases.TYPES}
    for qtype in det_cases.TYPES:
        data, x = det_cases.case(qtype)
        want = det_reference.matmul(x, data, qtype, (det_cases.ROWS, det_cases.COLS))
        assert hashlib.sha256(want.tobytes()).hexdigest() == expected[qtype.name], f"{qtype.name}: numpy"
        for isa in RUNNABLE:
            got = det_product(x, [(data, int(qtype))], det_cases.COLS, isa)
            assert hashlib.sha256(got.tobytes()).hexdigest() == expected[qtype.name], f"{qtype.name}: {isa}"
