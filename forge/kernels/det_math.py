"""det_math.h's exponential and logarithm in numpy: the same float32 operations in the same order, so the
same bits as every build of the compiled ones (the tests compare them). The deterministic numerics'
softmax, activations and log-probabilities are made of these."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

EXP_LO, EXP_HI = np.float32(-87.33654), np.float32(88.72283)
LOG2E = np.float32(1.44269504088896341)
C1, C2 = np.float32(0.693359375), np.float32(-2.12194440e-4)
EXP_P = [np.float32(v) for v in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                 1.6666665459e-1, 5.0000001201e-1)]
LOG_P = [np.float32(v) for v in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                                 1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                                 3.3333331174e-1)]


def det_exp(x: F32) -> F32:
    """det_math.h's det_exp, elementwise."""
    x = np.asarray(x, dtype=np.float32)
    x = np.where(x > EXP_LO, x, EXP_LO).astype(np.float32)
    x = np.where(x < EXP_HI, x, EXP_HI).astype(np.float32)
    n = np.rint(x * LOG2E).astype(np.float32)
    r = (x - n * C1).astype(np.float32)
    r = (r - n * C2).astype(np.float32)
    p = np.full_like(r, EXP_P[0])
    for c in EXP_P[1:]:
        p = (p * r + c).astype(np.float32)
    y = (((p * r) * r + r) + np.float32(1)).astype(np.float32)
    scale = ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(np.float32)
    out: F32 = (y * scale).astype(np.float32)
    return out


def det_log(x: F32) -> F32:
    """det_math.h's det_log, elementwise, for normal x > 0."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    e = ((bits >> 23) & 255).astype(np.int32) - 127
    m = ((bits & 0x007FFFFF) | 0x3F800000).astype(np.uint32).view(np.float32)
    high = m > np.float32(1.41421356)
    m = np.where(high, m * np.float32(0.5), m).astype(np.float32)
    fe = (e + high).astype(np.float32)
    f = (m - np.float32(1)).astype(np.float32)
    z = (f * f).astype(np.float32)
    p = np.full_like(f, LOG_P[0])
    for c in LOG_P[1:]:
        p = (p * f + c).astype(np.float32)
    y = ((f * z) * p + fe * C2).astype(np.float32)
    y = (y - np.float32(0.5) * z).astype(np.float32)
    out: F32 = ((f + y) + fe * C1).astype(np.float32)
    return out


def compiled_exp(x: F32, lib: ctypes.CDLL | None = None) -> F32:
    """det_exp by the compiled kernels (det_rowwise.c; `lib`: another level's build)."""
    return _compiled("forge_det_exp", x, lib)


def compiled_log(x: F32, lib: ctypes.CDLL | None = None) -> F32:
    """det_log by the compiled kernels."""
    return _compiled("forge_det_log", x, lib)


def _compiled(name: str, x: F32, lib: ctypes.CDLL | None) -> F32:
    from forge.kernels.compiled import library, ptr

    lib = lib or library()
    assert lib is not None, f"{name} called without the compiled kernels"
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    getattr(lib, name)(ptr(x), x.size, ptr(out))
    return out
