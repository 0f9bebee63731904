"""The deterministic numerics' row-wise kernels (forge/kernels/det_rowwise.c): every build level this host can
run gives the numpy definition's bits (forge.kernels.det_rowwise), over lengths that leave scalar tails after
the 16- and 8-lane loops, and the definitions stay close to the float64 truth."""

from __future__ import annotations

import numpy as np
import pytest

from forge.kernels import det_rowwise as dr
from tests.unit.test_block_linear import RUNNABLE
from tests.unit.test_det_math import bits, level

LENGTHS = [1, 7, 15, 16, 17, 33, 576, 1000]


def test_det_sum_is_its_partials_and_tree() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 37)).astype(np.float32)
    for row, got in zip(x, dr.det_sum(x), strict=True):
        p = [np.float32(0)] * 16
        for i, v in enumerate(row):
            p[i % 16] = np.float32(p[i % 16] + v)
        q = [np.float32(p[j] + p[j + 8]) for j in range(8)]
        r = [np.float32(q[j] + q[j + 4]) for j in range(4)]
        assert bits(np.float32([(r[0] + r[2]) + (r[1] + r[3])])) == bits(np.float32([got]))


@pytest.mark.parametrize("h", LENGTHS)
def test_rms_norm_is_the_definition_on_every_level(h: int) -> None:
    rng = np.random.default_rng(h)
    x = (rng.standard_normal((5, h)) * rng.uniform(0.01, 50, (5, 1))).astype(np.float32)
    w = rng.uniform(-2, 2, h).astype(np.float32)
    want = dr.rms_norm_def(x, w, 1e-5)
    truth = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.allclose(want, truth, rtol=1e-5, atol=1e-6)
    for isa in RUNNABLE:
        assert np.array_equal(bits(dr.rms_norm(x, w, 1e-5, lib=level(isa))), bits(want)), isa
        strided = np.zeros((5, h + 3), np.float32)                          # rows of a wider array, in place
        strided[:, 1:h + 1] = x
        dr.rms_norm(strided[:, 1:h + 1], w, 1e-5, out=strided[:, 1:h + 1], lib=level(isa))
        assert np.array_equal(bits(strided[:, 1:h + 1]), bits(want)), isa


def test_rms_norm_of_no_rows_is_no_rows() -> None:
    """A step's chunk that samples no row keeps none past the last attention: [0, H] (strides of any kind)."""
    x = np.zeros((5, 8), np.float32)[np.zeros(0, np.int64)]
    assert dr.rms_norm(x, np.ones(8, np.float32), 1e-5).shape == (0, 8)


def test_rms_norm_of_heads_is_each_heads_norm() -> None:
    rng = np.random.default_rng(1)
    heads = rng.standard_normal((4, 5, 24)).astype(np.float32)             # [T, nh + 2 nkv, hd]
    w = rng.uniform(0.5, 1.5, 24).astype(np.float32)
    want = dr.rms_norm_def(heads[:, :3].reshape(-1, 24), w, 1e-6).reshape(4, 3, 24)
    for isa in RUNNABLE:
        got = heads.copy()
        dr.rms_norm(got[:, :3], w, 1e-6, out=got[:, :3], lib=level(isa))
        assert np.array_equal(bits(got[:, :3]), bits(want)), isa
        assert np.array_equal(got[:, 3:], heads[:, 3:])


@pytest.mark.parametrize("kind", list(dr.GATED))
def test_gated_activations_are_the_definition_on_every_level(kind: str) -> None:
    rng = np.random.default_rng(2)
    for f in (1, 9, 23, 40, 1536):
        gate_up = (rng.standard_normal((3, 2 * f)) * 6).astype(np.float32)
        gate_up[0, :min(f, 4)] = [-200.0, 200.0, 0.0, -9.0][:min(f, 4)]
        want = dr.gated_def(gate_up, kind)
        for isa in RUNNABLE:
            assert np.array_equal(bits(dr.gated(gate_up, kind, lib=level(isa))), bits(want)), (isa, f)
    g, u = gate_up[:, :f].astype(np.float64), gate_up[:, f:].astype(np.float64)
    if kind == "silu":
        truth = g / (1 + np.exp(-g)) * u
    elif kind == "gelu_tanh":
        truth = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u
    else:
        gc, uc = np.minimum(g, 7), np.clip(u, -7, 7)
        truth = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
    assert np.allclose(want, truth, rtol=1e-5, atol=1e-5)


def test_logsumexp_and_softmax_are_the_definition_on_every_level() -> None:
    rng = np.random.default_rng(3)
    for n in LENGTHS + [49152]:
        x = (rng.standard_normal((3, n)) * 8).astype(np.float32)
        x[1, :: max(1, n // 5)] = -np.inf                                   # masked tokens
        x[1, 0] = 3.0
        lse, soft = dr.logsumexp_def(x), dr.softmax_def(x)
        truth = np.log(np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True)).sum(axis=1)) + x.max(axis=1)
        assert np.allclose(lse, truth, rtol=1e-6, atol=1e-5)
        assert np.allclose(soft.sum(axis=1), 1.0, atol=1e-5)
        for isa in RUNNABLE:
            assert np.array_equal(bits(dr.logsumexp(x, lib=level(isa))), bits(lse)), (isa, n)
            assert np.array_equal(bits(dr.softmax(x, lib=level(isa))), bits(soft)), (isa, n)


def test_tanh_is_the_definition_and_close_to_tanh() -> None:
    rng = np.random.default_rng(4)
    x = np.concatenate([rng.uniform(-1, 1, 3000), rng.uniform(-30, 30, 3000), [0.0, 0.625, -0.625, 100, -100]])
    x = x.astype(np.float32)
    want = dr.tanh_def(x)
    assert np.abs(want - np.tanh(x.astype(np.float64))).max() < 2e-7
    for isa in RUNNABLE:
        got = x.copy()
        dr.tanh_(got, lib=level(isa))
        assert np.array_equal(bits(got), bits(want)), isa


def test_dense_product_is_the_definition_on_every_level() -> None:
    rng = np.random.default_rng(5)
    for h in (16, 40, 576):
        x = rng.standard_normal((6, h)).astype(np.float32)
        w = rng.standard_normal((7, h)).astype(np.float32)
        want = dr.matmul_f32_def(x, w)
        assert np.allclose(want, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)
        for isa in RUNNABLE:
            assert np.array_equal(bits(dr.matmul_f32(x, w, lib=level(isa))), bits(want)), (isa, h)
