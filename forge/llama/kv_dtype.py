"""The K/V cache's storage types: float32, float16, or bfloat16 kept as its raw 16 bits.

numpy has no bfloat16, so a bfloat16 cache is a uint16 array of the values' upper halves (the
convention the compiled kernels share: uint16 storage means bfloat16). Writing rounds to the
nearest representable value, ties to even, as hardware conversions do; reading is exact.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.config import KV_CACHE_DTYPES

F32 = npt.NDArray[np.float32]

_STORAGE: dict[str, type[np.generic]] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def storage_dtype(name: str) -> type[np.generic]:
    """The numpy dtype that holds a cache of `name` (one of KV_CACHE_DTYPES)."""
    if name not in _STORAGE:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return _STORAGE[name]


def itemsize(name: str) -> int:
    return int(np.dtype(storage_dtype(name)).itemsize)


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
