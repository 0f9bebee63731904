"""The forward's projections, y = x @ W, in one place: how each product is laid out and how it uses the cores.

Owns the matmul strategy of the process: "blas" hands each product whole to BLAS and its thread pool;
"split" cuts the output columns into one slice per thread of a persistent pool of Python threads (the
caller takes one slice), each slice on 1-thread BLAS while numpy releases the GIL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from forge.config import MATMUL_STRATEGIES

F32 = npt.NDArray[np.float32]
T = TypeVar("T")

# Output columns of a slice are a multiple of this (one 64-byte cache line of float32).
COLUMN_ALIGN = 16
# Products smaller than this many multiply-adds run whole: a hand-off costs more than it saves.
MIN_SPLIT_MACS = 1 << 16
# A single row (one decoding sequence) runs whole: measured no faster split on a quiet machine, and
# about 2x slower split while another process holds a core (each half waits for the slower one).
MIN_SPLIT_ROWS = 2
# A weight stored [out, in] (an F-ordered [in, out] view) is multiplied weight-first, (W @ x.T).T, up to
# this many rows of x: measured faster for the 1536 -> 576 down projection at 1-64 rows, slower at 512.
MAX_WEIGHT_FIRST_ROWS = 64


def _product(x: F32, w: F32, out: F32) -> None:
    """out[...] = x @ w for x [T, in], w [in, out'] (a slice of the weight), out [T, out'] (may be a
    column slice of a wider array)."""
    if w.flags.f_contiguous and not w.flags.c_contiguous and x.shape[0] <= MAX_WEIGHT_FIRST_ROWS:
        out[...] = (w.T @ x.T).T                                 # [out', T] product, transposed into place
    else:
        np.matmul(x, w, out=out)                                 # [T, out']


def _column_cuts(num_cols: int, num_parts: int) -> list[tuple[int, int]]:
    """[lo, hi) column ranges, about equal, each boundary on a multiple of COLUMN_ALIGN."""
    bounds = [0]
    for i in range(1, num_parts):
        cut = -(-num_cols * i // num_parts // COLUMN_ALIGN) * COLUMN_ALIGN
        bounds.append(min(max(cut, bounds[-1]), num_cols))
    bounds.append(num_cols)
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


class Matmul:
    """y = x @ w for x [T, in] and w [in, out] (C-contiguous, or an F-ordered view of an [out, in]
    array); returns a C-contiguous [T, out] float32 array. Thread-safe."""

    def __init__(self, strategy: str = "blas", num_threads: int = 1) -> None:
        if strategy not in MATMUL_STRATEGIES:
            raise ValueError(f"matmul strategy must be one of {', '.join(MATMUL_STRATEGIES)}, got {strategy!r}")
        if num_threads < 1:
            raise ValueError(f"matmul threads must be positive, got {num_threads}")
        self.strategy = strategy
        self.num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None
        if strategy == "split" and num_threads > 1:
            self._pool = ThreadPoolExecutor(max_workers=num_threads - 1, thread_name_prefix="forge-matmul")

    def __call__(self, x: F32, w: F32) -> F32:
        out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)                # [T, out]
        pool = self._pool
        if pool is None or x.shape[0] < MIN_SPLIT_ROWS or x.shape[0] * w.shape[0] * w.shape[1] < MIN_SPLIT_MACS:
            _product(x, w, out)
            return out
        cuts = _column_cuts(w.shape[1], self.num_threads)
        futures = [pool.submit(_product, x, w[:, lo:hi], out[:, lo:hi]) for lo, hi in cuts[1:]]
        lo, hi = cuts[0]
        try:
            _product(x, w[:, lo:hi], out[:, lo:hi])
        finally:
            for future in futures:
                future.result()
        return out

    @property
    def num_parts(self) -> int:
        """How many pieces of work run_parts runs at once: the threads under "split", else 1."""
        return self.num_threads if self._pool is not None else 1

    def run_parts(self, fn: Callable[[T], None], parts: Sequence[T]) -> None:
        """fn(part) for every part: parts[1:] on the pool (when there is one), parts[0] on the
        calling thread; returns once all are done, raising the first failure. The parts must
        write disjoint memory; fn should spend its time in numpy calls that release the GIL."""
        pool = self._pool
        if pool is None or len(parts) < 2:
            for part in parts:
                fn(part)
            return
        futures = [pool.submit(fn, part) for part in parts[1:]]
        try:
            fn(parts[0])
        finally:
            for future in futures:
                future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"Matmul({self.strategy!r}, num_threads={self.num_threads})"


def product(x: F32, w: F32) -> F32:
    """x [T, in] @ w [in, out] -> C-contiguous [T, out] on the calling thread alone (BLAS's own
    threads aside): for callers that split the work over the pool themselves (run_parts)."""
    out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)                    # [T, out]
    _product(x, w, out)
    return out


_lock = threading.Lock()
_active = Matmul()


def linear(x: F32, w: F32) -> F32:
    """x [T, in] @ w [in, out] -> C-contiguous [T, out], with the process's matmul strategy."""
    return _active(x, w)


def active_matmul() -> Matmul:
    return _active


def configure_matmul(strategy: str, num_threads: int | None) -> Matmul:
    """Set the process-wide strategy and pin BLAS to match: "blas" sets the BLAS pool to num_threads
    (None: leaves the BLAS default); "split" runs num_threads slices (None: the usable cores) on
    1-thread BLAS. Call it while no forward runs; returns the new Matmul."""
    global _active
    if strategy == "split":
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threadpool_limits(limits=1, user_api="blas")
        new = Matmul("split", num_threads)
    else:
        new = Matmul(strategy, num_threads or 1)
        if num_threads is not None:
            threadpool_limits(limits=num_threads, user_api="blas")
    with _lock:
        old, _active = _active, new
    old.close()
    return new
