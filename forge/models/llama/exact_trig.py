"""RoPE's tables for the deterministic numerics: float64 exp, log, power, cos and sin made of numpy's elementwise
float64 operations (+ - * /, rint, frexp, ldexp: one IEEE rounding each, or exact), so the same bits on every
host, where np.cos, np.power and math.log are the host's libm or numpy's SIMD code, which may differ in the
last bit (and then round a float32 table entry the other way). Each within a few float64 ulp of the truth.

    exp(x)      n = rint(x / ln 2), r = (x - n L1) - n L2 (L1 + L2 = ln 2, n L1 exact), Taylor to r^13, times 2^n
    log(x)      x = m 2^e, m in [sqrt(1/2), sqrt(2)); s = (m - 1) / (m + 1); 2 s (1 + s^2 / 3 + ... + s^20 / 21)
                + e L2 + e L1
    power(b, y) exp(y log(b))
    cos, sin    n = rint(a / (pi / 2)), r = ((a - n P1) - n P2) - n P3 (P1 + P2 + P3 = pi / 2 to 118 bits, each n Pi
                exact for |n| < 2^20), fdlibm's kernel polynomials on r, the quadrant by n mod 4
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]

LN2_HI, LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
EXP_TAYLOR = [1.0 / math.factorial(k) for k in range(13, -1, -1)]           # exact divisions: 1/13! .. 1
PIO2 = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
INV_PIO2 = 6.36619772367581382433e-01
SIN_C = (1.58969099521155010221e-10, -2.50507602534068634195e-08, 2.75573137070700676789e-06,
         -1.98412698298579493134e-04, 8.33333333332248946124e-03, -1.66666666666666324348e-01)
COS_C = (-1.13596475577881948265e-11, 2.08757232129817482790e-09, -2.75573143513906633035e-07,
         2.48015872894767294178e-05, -1.38888888888741095749e-03, 4.16666666666666019037e-02)


def exp(x: F64) -> F64:
    """e^x for float64 |x| < 700."""
    x = np.asarray(x, np.float64)
    n = np.rint(x * INV_LN2)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = np.full_like(r, EXP_TAYLOR[0])
    for c in EXP_TAYLOR[1:]:
        p = p * r + c
    out: F64 = np.ldexp(p, n.astype(np.int32))
    return out


def log(x: F64) -> F64:
    """ln x for normal float64 x > 0."""
    m, e = np.frexp(np.asarray(x, np.float64))                               # m in [0.5, 1)
    low = m < 0.70710678118654752440
    m = np.where(low, m * 2.0, m)
    e = (e - low).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    p = np.full_like(s, 1.0 / 21.0)
    for k in range(19, 0, -2):
        p = p * z + 1.0 / k
    out: F64 = (2.0 * s * p + e * LN2_LO) + e * LN2_HI
    return out


def power(base: float, y: F64) -> F64:
    """base^y for base > 0."""
    return exp(np.asarray(y, np.float64) * log(np.array(base, np.float64)))


def cos_sin(a: F64) -> tuple[F64, F64]:
    """cos a and sin a for float64 |a| < 2^20 pi / 2."""
    a = np.asarray(a, np.float64)
    n = np.rint(a * INV_PIO2)
    r = ((a - n * PIO2[0]) - n * PIO2[1]) - n * PIO2[2]                       # [-pi/4, pi/4] about
    z = r * r
    s = np.full_like(r, SIN_C[0])
    for c in SIN_C[1:]:
        s = s * z + c
    sin_r = r + (r * z) * s
    c_ = np.full_like(r, COS_C[0])
    for c in COS_C[1:]:
        c_ = c_ * z + c
    cos_r = (1.0 - 0.5 * z) + (z * z) * c_
    quadrant = n.astype(np.int64) & 3
    cos_a = np.choose(quadrant, [cos_r, -sin_r, -cos_r, sin_r])
    sin_a = np.choose(quadrant, [sin_r, cos_r, -sin_r, -cos_r])
    return cos_a, sin_a
