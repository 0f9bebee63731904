"""The deterministic numerics' row-wise operations: their definitions in numpy (float32 operations in a fixed
order, each one IEEE rounding: the same bits on every host) and the compiled kernels that give those bits
(det_rowwise.c, whose header comment states each definition). The sums are det_sum's: 16 partial sums by
index mod 16, in index order, then a fixed tree; exp and log are forge.kernels.det_math's."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

from forge.kernels.det_math import det_exp, det_log

F32 = npt.NDArray[np.float32]

GELU_A, GELU_K = np.float32(0.044715), np.float32(-1.5957691216057308)     # K = -2 sqrt(2 / pi)
OAI_LIMIT, OAI_ALPHA = np.float32(7.0), np.float32(-1.702)
GATED = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}                     # det_rowwise.c's modes
TANH_P = [np.float32(v) for v in (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
                                  -3.33332819422e-1)]
ONE = np.float32(1.0)


# -- the definitions ------------------------------------------------------------------------------

def det_sum(terms: F32) -> F32:
    """det_sum of each row of terms [R, n]: [R]."""
    rows, n = terms.shape
    padded = np.zeros((rows, 16 + -(-n // 16) * 16), np.float32)             # a leading +0: each partial from +0
    padded[:, 16:16 + n] = terms
    partials = np.cumsum(padded.reshape(rows, -1, 16), axis=1, dtype=np.float32)[:, -1]   # [R, 16] in order
    q = partials[:, :8] + partials[:, 8:]
    r = q[:, :4] + q[:, 4:]
    s = r[:, :2] + r[:, 2:]
    out: F32 = s[:, 0] + s[:, 1]
    return out


def rms_norm_def(x: F32, weight: F32, eps: float) -> F32:
    """RMSNorm of the rows of x [R, h]: (x * (1 / sqrt(det_sum(x * x) / h + eps))) * weight."""
    x = np.asarray(x, np.float32)
    ss = det_sum(x * x)
    inv = ONE / np.sqrt(ss / np.float32(x.shape[1]) + np.float32(eps))
    out: F32 = (x * inv[:, None]) * weight
    return out


def gated_def(gate_up: F32, kind: str) -> F32:
    """The gated activation `kind` (GATED) of [gate | up] [n, 2f]: [n, f]."""
    half = gate_up.shape[1] // 2
    g, u = gate_up[:, :half].astype(np.float32), gate_up[:, half:].astype(np.float32)
    if kind == "silu":
        z = -g
    elif kind == "gelu_tanh":
        z = (((g * g) * GELU_A + ONE) * g) * GELU_K
    else:
        g = np.where(g < OAI_LIMIT, g, OAI_LIMIT)
        u = np.where(u < OAI_LIMIT, u, OAI_LIMIT)
        u = np.where(u > -OAI_LIMIT, u, -OAI_LIMIT) + ONE
        z = g * OAI_ALPHA
    out: F32 = (g / (ONE + det_exp(z))) * u
    return out


def logsumexp_def(x: F32) -> F32:
    """m + det_log(det_sum(det_exp(x - m))) of each row of x [R, n], m its max: [R]."""
    m = x.max(axis=1)
    out: F32 = m + det_log(det_sum(det_exp(x - m[:, None])))
    return out


def softmax_def(x: F32) -> F32:
    """det_exp(x - m) / det_sum of those, each row of x [R, n]."""
    e = det_exp(x - x.max(axis=1)[:, None])
    out: F32 = e / det_sum(e)[:, None]
    return out


def tanh_def(x: F32) -> F32:
    """Cephes' tanhf on det_exp, elementwise."""
    x = np.asarray(x, np.float32)
    a = np.abs(x)
    z = x * x
    p = np.full_like(x, TANH_P[0])
    for c in TANH_P[1:]:
        p = p * z + c
    small = (p * z) * x + x
    with np.errstate(over="ignore"):
        big = ONE - np.float32(2.0) / (det_exp(a + a) + ONE)
    out: F32 = np.where(a < np.float32(0.625), small, np.where(x < 0, -big, big)).astype(np.float32)
    return out


def matmul_f32_def(x: F32, w_rows: F32) -> F32:
    """out [T, E] = det_sum over i of x[t, i] * w_rows[e, i]."""
    terms = x[:, None, :] * w_rows[None, :, :]                              # [T, E, h]
    return det_sum(terms.reshape(-1, x.shape[1])).reshape(x.shape[0], w_rows.shape[0])


# -- the compiled kernels -------------------------------------------------------------------------

def _lib(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    from forge.kernels.compiled import library

    lib = lib or library()
    assert lib is not None, "the deterministic row-wise kernels called without the compiled kernels"
    return lib


def _checked(x: F32, what: str) -> F32:
    if x.dtype != np.float32 or (x.size and (x.strides[-1] != 4 or any(s % 4 for s in x.strides))):
        raise ValueError(f"{what} needs float32 rows with a contiguous last axis")
    return x


def rms_norm(x: F32, weight: F32, eps: float, out: F32 | None = None, lib: ctypes.CDLL | None = None) -> F32:
    """rms_norm_def over the last axis of x [R, h] or [A, B, h] (any view whose last axis is contiguous),
    into out (a new C-contiguous array; or x itself, in place). `lib`: another level's build."""
    from forge.kernels.compiled import ptr

    _checked(x, "rms_norm")
    out = np.empty(x.shape, np.float32) if out is None else _checked(out, "rms_norm")
    h = x.shape[-1]
    if out.shape != x.shape or weight.dtype != np.float32 or weight.shape != (h,) or not weight.flags.c_contiguous:
        raise ValueError("rms_norm needs out of x's shape and a contiguous float32 weight [h]")
    if x.size == 0:
        return out
    xs, os_ = (x[:, None], out[:, None]) if x.ndim == 2 else (x, out)
    _lib(lib).forge_det_rms_norm(ptr(x), xs.shape[0], xs.shape[1], xs.strides[0] // 4, xs.strides[1] // 4, h,
                                 ptr(weight), eps, ptr(out), os_.strides[0] // 4, os_.strides[1] // 4)
    return out


def gated(gate_up: F32, kind: str, lib: ctypes.CDLL | None = None) -> F32:
    """gated_def by the compiled kernels: [n, 2f] -> C-contiguous [n, f]."""
    from forge.kernels.compiled import ptr

    gate_up = np.ascontiguousarray(gate_up, dtype=np.float32)
    n, two_f = gate_up.shape
    out = np.empty((n, two_f // 2), np.float32)
    _lib(lib).forge_det_gated(ptr(gate_up), n, two_f // 2, GATED[kind], ptr(out))
    return out


def logsumexp(x: F32, lib: ctypes.CDLL | None = None) -> F32:
    """logsumexp_def of each row of x [R, n] (n >= 1; rows any stride apart): [R]."""
    from forge.kernels.compiled import ptr

    _checked(x, "logsumexp")
    out = np.empty(x.shape[0], np.float32)
    _lib(lib).forge_det_logsumexp(ptr(x), x.shape[0], x.shape[1], x.strides[0] // 4, ptr(out))
    return out


def softmax(x: F32, lib: ctypes.CDLL | None = None) -> F32:
    """softmax_def of each row of x [R, n]: C-contiguous [R, n]."""
    from forge.kernels.compiled import ptr

    _checked(x, "softmax")
    out = np.empty(x.shape, np.float32)
    _lib(lib).forge_det_softmax(ptr(x), x.shape[0], x.shape[1], x.strides[0] // 4, ptr(out))
    return out


def exp_(x: F32, lib: ctypes.CDLL | None = None) -> None:
    """x <- det_exp(x) in place (x C-contiguous float32)."""
    _elementwise_("forge_det_exp", x, lib)


def tanh_(x: F32, lib: ctypes.CDLL | None = None) -> None:
    """x <- tanh_def(x) in place (x C-contiguous float32)."""
    _elementwise_("forge_det_tanh", x, lib)


def _elementwise_(name: str, x: F32, lib: ctypes.CDLL | None) -> None:
    from forge.kernels.compiled import ptr

    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"{name} needs a C-contiguous float32 array")
    getattr(_lib(lib), name)(ptr(x), x.size, ptr(x))


def matmul_f32(x: F32, w_rows: F32, lib: ctypes.CDLL | None = None) -> F32:
    """matmul_f32_def by the compiled kernels: x [T, h] @ w_rows [E, h].T -> [T, E]."""
    from forge.kernels.compiled import ptr

    x = np.ascontiguousarray(x, dtype=np.float32)
    w_rows = np.ascontiguousarray(w_rows, dtype=np.float32)
    if w_rows.shape[1] != x.shape[1]:
        raise ValueError("matmul_f32 needs x [T, h] and w_rows [E, h]")
    out = np.empty((x.shape[0], w_rows.shape[0]), np.float32)
    _lib(lib).forge_det_matmul_f32(ptr(x), x.shape[0], x.shape[1], ptr(w_rows), w_rows.shape[0], ptr(out))
    return out
