"""The K/V cache's storage types: float32, float16, bfloat16 kept as its raw 16 bits, and int8
with a float16 scale per group of 32 values.

numpy has no bfloat16, so a bfloat16 cache is a uint16 array of the values' upper halves (the
convention the compiled kernels share: uint16 storage means bfloat16). Writing rounds to the
nearest representable value, ties to even, as hardware conversions do; reading is exact.

int8 is llama.cpp's q8_0 laid out for paged attention, on rotated values: each run of
INT8_GROUP values of a head's row (head_dim a multiple of it) is first multiplied by the 32 x 32
Walsh-Hadamard matrix H (hadamard32; H H = 32 I), which spreads a channel's outlier over its group,
then stored as q = rint(y / d), |q| <= 127, with d = max |y| / 127 rounded to float16; the values
sit in an int8 array shaped like the float cache, the scales in a float16 array with the last axis
divided by INT8_GROUP (rotated magnitudes up to 127 x 65504, about 8.3e6, beyond which they
saturate). Reading widens q * d (exact in float32): H x, not x. Attention over such a
cache rotates the queries by H / 32 first (their scores are then q . x) and its outputs by H / 32
after (forge.models.llama.attention). 34 bytes per 32 values: 3.76x the tokens of float32 in the same
memory.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.config import KV_CACHE_DTYPES
from forge.kernels import compiled

F32 = npt.NDArray[np.float32]

_STORAGE: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
                                         "int8": np.int8}
INT8_GROUP = compiled.INT8_GROUP   # values per scale of an int8 cache (the compiled kernels' KV_INT8_GROUP)
_INV127 = np.float32(1) / np.float32(127)
_F16_MAX = np.float32(65504)


def storage_dtype(name: str) -> type[np.generic]:
    """The numpy dtype that holds a cache of `name` (one of KV_CACHE_DTYPES)."""
    if name not in _STORAGE:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _STORAGE[name]


def itemsize(name: str) -> int:
    return int(np.dtype(storage_dtype(name)).itemsize)


def row_bytes(name: str, head_dim: int) -> int:
    """Bytes one head's K (or V) row of head_dim values costs in a cache of `name`, scales included."""
    if name == "int8":
        return head_dim + 2 * (head_dim // INT8_GROUP)
    return head_dim * itemsize(name)


def check_head_dim(name: str, head_dim: int) -> None:
    """Raise ValueError when a cache of `name` cannot hold heads of head_dim."""
    if name == "int8" and head_dim % INT8_GROUP:
        raise ValueError(f"an int8 K/V cache needs head_dim a multiple of {INT8_GROUP}, this model's is {head_dim}")


def hadamard32(x: F32, scale: float = 1.0) -> F32:
    """H y * scale for each run y of 32 values along the last axis of x [..., n] (n a multiple of
    32), H the unnormalised 32 x 32 Walsh-Hadamard matrix: five stages of butterflies, the same
    additions in the same order as the compiled kernels' (elementwise.c). A new array."""
    y = np.array(x, dtype=np.float32).reshape(-1, INT8_GROUP)
    h = 1
    while h < INT8_GROUP:
        pairs = y.reshape(len(y), INT8_GROUP // (2 * h), 2, h)
        a = pairs[:, :, 0].copy()
        b = pairs[:, :, 1]
        pairs[:, :, 0] = a + b
        pairs[:, :, 1] = a - b
        h *= 2
    if scale != 1.0:
        y *= np.float32(scale)
    return y.reshape(x.shape)


def quantize_int8(x: F32) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float16]]:
    """float32 values [..., n] (n a multiple of INT8_GROUP) as an int8 cache stores them, rotated
    by hadamard32 and quantized: (q [..., n] int8, scales [..., n / INT8_GROUP] float16). The
    reference the compiled writer (elementwise.c's forge_kv_store) matches bit for bit: the
    same float32 operations in the same order (NaN counts as 0 in the maximum and rounds to -127;
    infinities saturate)."""
    groups = hadamard32(x).reshape(*x.shape[:-1], -1, INT8_GROUP)                          # [..., G, 32]
    amax = np.fmax.reduce(np.abs(groups), axis=-1, initial=np.float32(0))                     # [..., G]
    scales = np.fmin(amax * _INV127, _F16_MAX).astype(np.float16)
    d = scales.astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        q = np.fmin(np.fmax(np.rint(groups * inv[..., None]), np.float32(-127)), np.float32(127))
    return q.astype(np.int8).reshape(x.shape), scales


def dequantize_int8(q: npt.NDArray[np.int8], scales: npt.NDArray[np.float16], out: F32 | None = None) -> F32:
    """An int8 cache's values [..., n] and scales [..., n / INT8_GROUP] as float32 (exact): the
    rotated values (hadamard32(x) for the x written, to within half a step)."""
    if out is None:
        out = np.empty(q.shape, dtype=np.float32)
    grouped = out.reshape(*q.shape[:-1], -1, INT8_GROUP)
    np.multiply(q.reshape(grouped.shape), scales[..., None], out=grouped, dtype=np.float32)
    return out


def to_storage(x: F32, storage: np.dtype[np.generic]) -> npt.NDArray[np.generic]:
    """float32 values as the cache stores them (a new array unless already float32)."""
    if storage == np.float32:
        return x
    if storage == np.float16:
        return x.astype(np.float16)
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    nan = np.isnan(x)
    # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then keep the top half
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16
    out = rounded.astype(np.uint16)
    out[nan] = ((bits[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)   # stays a (quiet) NaN
    return out


def to_float32(a: npt.NDArray[np.generic], out: F32 | None = None) -> F32:
    """Cache contents back to float32 (exact), into `out` when given ([a.shape] float32)."""
    if out is None:
        out = np.empty(a.shape, dtype=np.float32)
    if a.dtype == np.uint16:
        np.left_shift(a, 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        out[...] = a
    return out
