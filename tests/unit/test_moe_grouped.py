"""The grouped product of a mixture of experts (forge/kernels/moe_matmul.c: every active expert's rows in
one call on the kernel pool) against one product per expert (qmatmul.c), bit for bit, for every type the
compiled products read, in both numerics, at every instruction-set level this host runs, on 1 to 3
threads; and the block (forge.models.llama.mixture) on it against its loop over the experts."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.kernels import compiled, products
from forge.kernels.quant_blocks import affine_blocks
from forge.models.llama import experts as experts_mod
from forge.models.llama.experts import ExpertStack, MoeWeights
from forge.models.llama.linear import matmul_unsplit
from forge.models.llama.llama_config import MoeConfig
from forge.models.llama.llama_model import swiglu
from forge.models.llama.mixture import expert_groups, grouped_experts, mixture, route

Q = GGMLQuantizationType
HAVE_KERNELS = compiled.library() is not None
pytestmark = pytest.mark.skipif(not HAVE_KERNELS, reason="no compiled kernels here")
QUANTIZED = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PLAIN = [Q.F32, Q.F16, Q.BF16]
# Byte offsets of each block's float16 scales: random bytes there could be inf or NaN.
F16_AT = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208]}
LEVELS = ["native", "avx2", "baseline"]


def expert_tensor(rng: np.random.Generator, qtype: GGMLQuantizationType, experts: int, rows: int,
                  k: int) -> tuple[npt.NDArray[np.generic], npt.NDArray[np.float32]]:
    """A random 3-D expert tensor [experts, rows, bytes per row] (or [experts, rows, k] of a plain type)
    as the file holds it, and the float32 values it means [experts, rows, k]."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        w = rng.standard_normal((experts, rows, k)).astype(np.float32)
        if qtype == Q.F16:
            return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
        if qtype == Q.BF16:
            bits = (w.view(np.uint32) >> 16).astype(np.uint16)
            return bits, (bits.astype(np.uint32) << 16).view(np.float32)
        return w, w
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    n = experts * rows * k // elems
    blocks = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for off in F16_AT[qtype]:
        blocks[:, off:off + 2] = rng.uniform(0.001, 0.05, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    data = blocks.reshape(experts, rows, -1)
    values = affine_blocks(data.reshape(experts * rows, -1), qtype, (experts * rows, k)).dequantize()
    return data, values.reshape(experts, rows, k)


@pytest.fixture(scope="module", params=LEVELS)
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    try:
        return compiled.library_at(request.param)
    except RuntimeError as exc:                 # a level this host's compiler cannot build
        pytest.skip(str(exc))


def per_expert(lib: ctypes.CDLL, x: npt.NDArray[np.float32], parts: list[tuple[npt.NDArray[np.generic], Q]],
               expert: int, k: int, fast: bool) -> npt.NDArray[np.float32]:
    """x @ W_expert.T by one qmatmul over that expert's rows of every part (a BlockMatrix's product)."""
    rows = [(np.ascontiguousarray(data[expert]).view(np.uint8).reshape(data.shape[1], -1), int(t)) for data, t in parts]
    out = np.empty((x.shape[0], sum(r.shape[0] for r, _ in rows)), dtype=np.float32)
    products.qmatmul(np.ascontiguousarray(x), k, products.qparts(rows), out, lib=lib, fast=fast)
    return out


def grouped(lib: ctypes.CDLL, x: npt.NDArray[np.float32], parts: list[tuple[npt.NDArray[np.generic], Q]],
            experts: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], k: int,
            fast: bool) -> npt.NDArray[np.float32]:
    whole = [(data.view(np.uint8).reshape(data.shape[0] * data.shape[1], -1), int(t)) for data, t in parts]
    descriptor = products.qparts(whole)
    for part, (data, _) in zip(descriptor, parts, strict=True):
        part.rows = data.shape[1]
    out = np.empty((x.shape[0], sum(data.shape[1] for data, _ in parts)), dtype=np.float32)
    products.moe_matmul(x, k, descriptor, parts[0][0].shape[0], experts, starts, out, fast=fast, lib=lib)
    return out


@settings(max_examples=30, deadline=None)
@given(qtypes=st.lists(st.sampled_from(QUANTIZED + PLAIN), min_size=1, max_size=2),
       rows=st.lists(st.integers(1, 140), min_size=2, max_size=2), blocks_along_k=st.integers(1, 3),
       num_experts=st.integers(1, 10), group_rows=st.lists(st.integers(0, 20), min_size=1, max_size=10),
       fast=st.booleans(), threads=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_the_grouped_product_has_the_bits_of_one_product_per_expert(
        lib: ctypes.CDLL, qtypes: list[GGMLQuantizationType], rows: list[int], blocks_along_k: int,
        num_experts: int, group_rows: list[int], fast: bool, threads: int, seed: int) -> None:
    fast = fast and products.qmatmul_fast(lib)
    rng = np.random.default_rng(seed)
    k = blocks_along_k * (256 if set(qtypes) & {Q.Q4_K, Q.Q5_K, Q.Q6_K} else 32)
    made = [expert_tensor(rng, t, num_experts, r, k) for t, r in zip(qtypes, rows, strict=False)]
    parts = [(data, t) for (data, _), t in zip(made, qtypes, strict=False)]
    group_rows = group_rows[:num_experts]
    experts = rng.permutation(num_experts)[:len(group_rows)].astype(np.int64)     # any order, each once
    starts = np.concatenate([[0], np.cumsum(group_rows)]).astype(np.int64)
    x = rng.standard_normal((int(starts[-1]), k)).astype(np.float32)
    products.pool_threads(threads, lib=lib)
    try:
        got = grouped(lib, x, parts, experts, starts, k, fast)
    finally:
        products.pool_threads(2, lib=lib)
    for g, expert in enumerate(experts.tolist()):
        lo, hi = int(starts[g]), int(starts[g + 1])
        np.testing.assert_array_equal(got[lo:hi], per_expert(lib, x[lo:hi], parts, expert, k, fast))
        if not fast:                         # and that product is the float32 one of the file's values
            w = np.concatenate([values[expert] for _, values in made]).astype(np.float64)
            want = x[lo:hi].astype(np.float64) @ w.T
            scale = np.abs(x[lo:hi]).astype(np.float64) @ np.abs(w).T + 1e-30
            assert np.all(np.abs(got[lo:hi] - want) / scale < 1e-5)


def test_bad_groups_are_refused() -> None:
    rng = np.random.default_rng(0)
    data, _ = expert_tensor(rng, Q.Q8_0, 4, 8, 64)
    lib = compiled.library_at("native")
    x = np.ones((3, 64), dtype=np.float32)
    for experts, starts in (([4], [0, 3]), ([-1], [0, 3]), ([0, 1], [0, 2, 2]), ([0, 1], [0, 3, 2]), ([0], [1, 3])):
        with pytest.raises(ValueError, match="experts outside the tensors, or starts"):
            grouped(lib, x, [(data, Q.Q8_0)], np.array(experts, np.int64), np.array(starts, np.int64), 64, False)
    with pytest.raises(ValueError, match="disagree"):
        grouped(lib, np.ones((3, 32), np.float32), [(data, Q.Q8_0)], np.array([0], np.int64),
                np.array([0, 3], np.int64), 64, False)


@settings(max_examples=25, deadline=None)
@given(num_tokens=st.integers(1, 40), num_experts=st.integers(2, 16), k_frac=st.floats(0, 1), norm=st.booleans(),
       qtype=st.sampled_from([Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F32]), fast=st.booleans(), seed=st.integers(0, 2**16))
def test_the_block_on_the_grouped_product_has_the_bits_of_its_loop(num_tokens: int, num_experts: int, k_frac: float,
                                                                    norm: bool, qtype: GGMLQuantizationType,
                                                                    fast: bool, seed: int) -> None:
    """mixture() on kernel-held experts (one grouped product per projection) against the loop over the
    active experts it runs otherwise (one BlockMatrix product each, the outputs added in expert order)."""
    fast = fast and products.qmatmul_fast()
    rng = np.random.default_rng(seed)
    hidden, ffn = 256, 512
    top_k = 1 + int(k_frac * (num_experts - 1))
    gate_up = ExpertStack([(expert_tensor(rng, qtype, num_experts, ffn, hidden)[0], qtype) for _ in range(2)],
                          hidden, kernel=True, fast=fast)
    down = ExpertStack([(expert_tensor(rng, qtype, num_experts, hidden, ffn)[0], qtype)], ffn, kernel=True,
                       fast=fast)
    router = (rng.standard_normal((hidden, num_experts)) / 16).astype(np.float32)
    moe = MoeWeights(router=router, gate_up=gate_up, down=down)
    config = MoeConfig(num_experts=num_experts, num_used=top_k, expert_ffn=ffn, norm_top_k=norm)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    got = mixture(x, moe, config, matmul_unsplit, swiglu)
    ids, weights = route(matmul_unsplit(x, router), top_k, norm)
    want = np.zeros_like(x)
    for expert, tokens, chosen in expert_groups(ids, weights):
        y = matmul_unsplit(swiglu(matmul_unsplit(x[tokens], gate_up[expert])), down[expert])
        y *= chosen[:, None]
        want[tokens] += y
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(grouped_experts(x, moe, ids, weights, swiglu), want)


@pytest.mark.parametrize("advice", [experts_mod.MADV_POPULATE_READ, -1])     # -1: refused, one read a page
def test_the_experts_pages_are_mapped_in_the_background(monkeypatch: pytest.MonkeyPatch, advice: int) -> None:
    monkeypatch.setattr(experts_mod, "MADV_POPULATE_READ", advice)
    rng = np.random.default_rng(1)
    stacks = [ExpertStack([(expert_tensor(rng, Q.Q4_K, 4, 64, 256)[0], Q.Q4_K)], 256, kernel=True)]
    thread = experts_mod.prefault_experts(stacks)
    assert thread is not None
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert experts_mod.prefault_experts([]) is None
