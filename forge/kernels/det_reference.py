"""The deterministic numerics' product defined in numpy: what every build of qmatmul_det.c must give
bit for bit (the tests compare them).

    x per block of 32 values: dx = max|x| / 16256, codes q = rint(x * (16256 / max|x|)) (nearest even)
      clamped to +-16256 (all 0 where max|x| is below 2^-100; -16256 where the product is not finite),
      bsum = the sum of the block's codes, h0 / h1 the sums of its two halves;
    weight block: codes c with a scale A, offset M, zero point z and group scales s0, s1 (Q6_K's two
      groups of 16; 1 otherwise):
        I = s0 * sum(c q over the first 16) + s1 * sum(c q over the last 16) - z * (s0 h0 + s1 h1)
    p = (A * dx) * float(I) + (M * dx) * float(bsum), each product and sum one float32 rounding;
    out = ((0 + p_0) + p_1) + ... over the row's blocks in order.

    type   codes c             A           M              z
    Q4_0   0..15               d           0              8
    Q4_1   0..15               d           m              0
    Q5_0   0..31               d           0              16
    Q5_1   0..31               d           m              0
    Q8_0   -128..127           d           0              0
    Q4_K   0..15               d * sc      -(dmin * mn)   0
    Q5_K   0..31               d * sc      -(dmin * mn)   0
    Q6_K   0..63               d           0              32   (s0, s1: the int8 scales of the halves)

The integers are exact (|I| < 2**31); float(I) rounds to nearest even, and the float32 operations round
in the order written, so nothing about the host, the batch or the threads can change the result. x's
15-bit codes are what keep the fidelity: 8-bit ones (llama.cpp's Q8_0 activations) kept 6 of 26 greedy
continuations of the reference set (docs/design.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.kernels.quant_blocks import affine_blocks, check_blocks

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# ggml type -> zero point z
_ZERO = {GGMLQuantizationType.Q4_0: 8, GGMLQuantizationType.Q4_1: 0, GGMLQuantizationType.Q5_0: 16,
         GGMLQuantizationType.Q5_1: 0, GGMLQuantizationType.Q8_0: 0, GGMLQuantizationType.Q4_K: 0,
         GGMLQuantizationType.Q5_K: 0, GGMLQuantizationType.Q6_K: 32}
TYPES = frozenset(_ZERO)
XMAX = 16256          # x's codes: 127 * 128, 15 bits (qmatmul_det.c's DET_XMAX)
TINY = np.float32(2.0**-100)   # a block whose max|x| is below this is zeros (DET_TINY)


def quantize(x: F32) -> tuple[I64, F32, I64, I64]:
    """x [T, K] as codes [T, nb, 32], dx [T, nb], bsum [T, nb] and half sums [T, nb, 2]."""
    t, k = x.shape
    v = np.ascontiguousarray(x, dtype=np.float32).reshape(t, k // 32, 32)
    amax = np.fmax.reduce(np.abs(v), axis=2)                                 # [T, nb] (a NaN drops out)
    amax = np.where(amax >= TINY, amax, np.float32(0)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(XMAX) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
        dx = (amax / np.float32(XMAX)).astype(np.float32)
        p = v * inv[:, :, None]
        r = np.where(np.isfinite(p) & (np.abs(p) < 2**31), np.rint(p), -XMAX)
    q = np.clip(r, -XMAX, XMAX).astype(np.int64)                             # [T, nb, 32]
    halves = q.reshape(t, k // 32, 2, 16).sum(axis=3)                        # [T, nb, 2]
    return q, dx, halves.sum(axis=2), halves


def weight_blocks(data: npt.NDArray[Any], qtype: GGMLQuantizationType, shape: tuple[int, int]
                  ) -> tuple[I64, F32, F32, I64, I64]:
    """A matrix's blocks of 32 as codes [N, nb, 32], A and M [N, nb], z [] and group scales [N, nb, 2]."""
    if qtype not in _ZERO:
        raise ValueError(f"the deterministic product does not read {qtype.name}")
    check_blocks(data, qtype, shape)
    rows, cols = shape
    nb = cols // 32
    if qtype == GGMLQuantizationType.Q6_K:
        b = np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[qtype][1])
        codes = affine_blocks(data, qtype, shape).codes.astype(np.int64).reshape(rows, nb, 32)
        d = np.ascontiguousarray(b[:, 208:210]).view(np.float16).astype(np.float32)[:, 0]   # [rows * nb / 8]
        groups = b[:, 192:208].view(np.int8).astype(np.int64).reshape(rows, nb, 2)
        a: F32 = np.repeat(d, 8).reshape(rows, nb)
        return codes, a, np.zeros_like(a), np.asarray(32, dtype=np.int64), groups
    blocks = affine_blocks(data, qtype, shape)
    codes = blocks.codes.astype(np.int64).reshape(rows, nb, 32)
    scale = blocks.scale.reshape(rows, nb)          # one scale per 32 for every type but Q6_K
    offset = blocks.offset.reshape(rows, nb)
    z = _ZERO[qtype]
    if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q5_K):
        m = offset.astype(np.float32)
    else:
        m = np.zeros_like(scale)
    if qtype == GGMLQuantizationType.Q8_0:
        codes = codes - 128                         # affine_blocks holds the int8 + 128
    ones = np.ones((rows, nb, 2), dtype=np.int64)
    return codes, scale.astype(np.float32), m.astype(np.float32), np.asarray(z, dtype=np.int64), ones


def matmul(x: F32, data: npt.NDArray[Any], qtype: GGMLQuantizationType, shape: tuple[int, int]) -> F32:
    """x [T, K] @ W.T [K, N] by the definition above: float32 [T, N]."""
    q, dx, bsum, halves = quantize(x)
    codes, a, m, z, groups = weight_blocks(data, qtype, shape)
    t, nb = dx.shape
    sums = np.einsum("nbgi,tbgi->tnbg", codes.reshape(-1, nb, 2, 16), q.reshape(t, nb, 2, 16))   # [T, N, nb, 2]
    ints = (sums * groups[None]).sum(axis=3) - z * (groups[None] * halves[:, None]).sum(axis=3)   # [T, N, nb]
    assert np.abs(ints).max(initial=0) < 2**31
    out = np.zeros((t, shape[0]), dtype=np.float32)
    for b in range(nb):
        term = (a[None, :, b] * dx[:, b, None]) * ints[:, :, b].astype(np.float32)
        term = term + (m[None, :, b] * dx[:, b, None]) * bsum[:, b, None].astype(np.float32)
        out = out + term
    return out
