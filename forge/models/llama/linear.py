"""The forward's projections, y = x @ W, in one place: every x @ w of the forward is a `matmul`.

Owns the process's MatmulPool: under "blas" each matmul goes whole to BLAS and its thread pool; under
"split" the output columns are cut into one slice per thread of a persistent pool of Python threads (the
caller takes one slice), each slice on 1-thread BLAS while numpy releases the GIL. The pool hands work
over with one lock per direction per thread: a round trip costs 16-19 us where a concurrent.futures
executor costs 24-36 us (scripts/ab/ab_engine.py pool), and a decode step makes ~150 hand-offs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

from forge.config import MATMUL_STRATEGIES
from forge.kernels import products
from forge.models.llama.weight_types import PoolKernel, Weight

F32 = npt.NDArray[np.float32]
T = TypeVar("T")
MatmulFn = Callable[[F32, Weight], F32]  # x [T, in] @ w [in, out] -> [T, out]: matmul or matmul_unsplit

# Output columns of a slice are a multiple of this (one 64-byte cache line of float32).
COLUMN_ALIGN = 16
# Matmuls smaller than this many multiply-adds run whole: a hand-off costs more than it saves.
MIN_SPLIT_MACS = 1 << 16
# A matmul of fewer rows than this (a single decoding sequence: a matrix-vector product, bound by
# reading the weight) is split only from MIN_SPLIT_MACS_FEW_ROWS multiply-adds: measured on 2 cores
# at one row (scripts/ab/ab_engine.py matvec), the gate/up projection (1.8M) 28% faster split and the
# 49k-row head (28M) 43%, while q/k/v (0.55M), the output (0.33M) and down (0.88M) projections were
# 27-48% slower split.
MIN_SPLIT_ROWS = 2
MIN_SPLIT_MACS_FEW_ROWS = 1 << 20
# A weight stored [out, in] (an F-ordered [in, out] view) is multiplied weight-first, (W @ x.T).T, up to
# this many rows of x: measured faster for the 1536 -> 576 down projection at 1-64 rows, slower at 512.
MAX_WEIGHT_FIRST_ROWS = 64


def _matmul_into(x: F32, w: F32, out: F32) -> None:
    """out[...] = x @ w for x [T, in], w [in, out'] (a slice of the weight), out [T, out'] (may be a
    column slice of a wider array)."""
    if w.flags.f_contiguous and not w.flags.c_contiguous and x.shape[0] <= MAX_WEIGHT_FIRST_ROWS:
        out[...] = (w.T @ x.T).T                                 # [out', T], transposed into place
    else:
        np.matmul(x, w, out=out)                                 # [T, out']


def _column_cuts(num_cols: int, num_parts: int) -> list[tuple[int, int]]:
    """[lo, hi) column ranges, about equal, each boundary on a multiple of COLUMN_ALIGN."""
    bounds = [0]
    for i in range(1, num_parts):
        cut = -(-num_cols * i // num_parts // COLUMN_ALIGN) * COLUMN_ALIGN
        bounds.append(min(max(cut, bounds[-1]), num_cols))
    bounds.append(num_cols)
    return [(lo, hi) for lo, hi in pairwise(bounds) if hi > lo]


class _Worker:
    """One pool thread: runs fn(arg) each time the caller opens `go`, opens `done` after."""

    def __init__(self, name: str) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job: tuple[Callable[[Any], None], Any] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            job = self._job
            if job is None:                       # closed
                self._done.release()
                return
            try:
                job[0](job[1])
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, re-raised there
                self._error = exc
            self._done.release()

    def start(self, fn: Callable[[Any], None], arg: Any) -> None:
        self._job = (fn, arg)
        self._go.release()

    def wait(self) -> BaseException | None:
        """Block until the job started last is done; its exception, if it raised one."""
        self._done.acquire()
        error, self._error = self._error, None
        return error

    def close(self) -> None:
        self._job = None
        self._go.release()
        self._done.acquire()
        self._thread.join()


class _Workers:
    """num_threads - 1 workers; the calling thread is the first. One caller at a time: a call that
    finds them busy (another thread, or a job calling back in) runs its parts itself."""

    def __init__(self, num_threads: int) -> None:
        self._workers = [_Worker(f"forge-matmul-{i}") for i in range(1, num_threads)]
        self._busy = threading.Lock()

    def run(self, fn: Callable[[Any], None], parts: Sequence[Any]) -> None:
        if not self._busy.acquire(blocking=False):
            for part in parts:
                fn(part)
            return
        try:
            started = list(zip(self._workers, parts[1:], strict=False))  # either may be the longer
            for worker, part in started:
                worker.start(fn, part)
            errors: list[BaseException] = []
            try:
                fn(parts[0])
            finally:
                for worker, _ in started:
                    error = worker.wait()
                    if error is not None:
                        errors.append(error)
            for part in parts[1 + len(started):]:  # more parts than threads: the caller runs the rest
                fn(part)
            if errors:
                raise errors[0]
        finally:
            self._busy.release()

    def close(self) -> None:
        with self._busy:
            for worker in self._workers:
                worker.close()
            self._workers = []


class MatmulPool:
    """A matmul strategy and, under "split" with more than one thread, its pool of worker threads:
    matmul() computes x @ w on it, run_parts() lends it to other row- or part-parallel work.
    Thread-safe."""

    def __init__(self, strategy: str = "blas", num_threads: int = 1) -> None:
        if strategy not in MATMUL_STRATEGIES:
            raise ValueError(f"matmul strategy must be one of {', '.join(MATMUL_STRATEGIES)}, got {strategy!r}")
        if num_threads < 1:
            raise ValueError(f"matmul threads must be positive, got {num_threads}")
        self.strategy = strategy
        self.num_threads = num_threads
        self._workers: _Workers | None = None
        if strategy == "split" and num_threads > 1:
            self._workers = _Workers(num_threads)

    def matmul(self, x: F32, w: Weight) -> F32:
        """x @ w for x [T, in] and w [in, out] (C-contiguous, or an F-ordered view of an [out, in]
        array): a C-contiguous [T, out] float32 array, its columns split over the workers when it
        is big enough. A kernel-held weight (forge.kernels) multiplies on its own threads."""
        workers = self._workers
        if not isinstance(w, np.ndarray):
            dense_rows = getattr(w, "dense_rows", None)
            if workers is None or dense_rows is None or x.shape[0] < dense_rows:
                return w.matmul(x)
            # A kernel that multiplies big steps on the pool: x prepared once, then each thread
            # multiplies by its own range of the output columns.
            kernel = cast(PoolKernel, w)
            xs = kernel.split_rows(x)
            out = np.empty((x.shape[0], kernel.shape[1]), dtype=np.float32)
            workers.run(lambda cut: kernel.dense_into(xs, out, cut), kernel.column_cuts(self.num_threads))
            return out
        macs = x.shape[0] * w.shape[0] * w.shape[1]
        if workers is None or macs < (MIN_SPLIT_MACS if x.shape[0] >= MIN_SPLIT_ROWS else MIN_SPLIT_MACS_FEW_ROWS):
            return matmul_unsplit(x, w)
        out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)                # [T, out]
        cuts = _column_cuts(w.shape[1], self.num_threads)
        workers.run(lambda cut: _matmul_into(x, w[:, cut[0]:cut[1]], out[:, cut[0]:cut[1]]), cuts)
        return out

    @property
    def num_parts(self) -> int:
        """How many pieces of work run_parts runs at once: the threads under "split", else 1."""
        return self.num_threads if self._workers is not None else 1

    def run_parts(self, fn: Callable[[T], None], parts: Sequence[T]) -> None:
        """fn(part) for every part: parts[1:] on the workers (when there are any), parts[0] on the
        calling thread; returns once all are done, raising the first failure. The parts must
        write disjoint memory; fn should spend its time in numpy calls that release the GIL."""
        workers = self._workers
        if workers is None or len(parts) < 2:
            for part in parts:
                fn(part)
            return
        workers.run(fn, parts)

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __repr__(self) -> str:
        return f"MatmulPool({self.strategy!r}, num_threads={self.num_threads})"


def matmul_unsplit(x: F32, w: Weight) -> F32:
    """x [T, in] @ w [in, out] -> C-contiguous [T, out] on the calling thread alone (BLAS's own
    threads aside): for callers that split the work over the pool themselves (run_parts)."""
    if not isinstance(w, np.ndarray):
        return w.matmul(x)
    out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)                    # [T, out]
    _matmul_into(x, w, out)
    return out


_lock = threading.Lock()
_active = MatmulPool()


def matmul(x: F32, w: Weight) -> F32:
    """x [T, in] @ w [in, out] -> C-contiguous [T, out], on the process's MatmulPool."""
    return _active.matmul(x, w)


def active_pool() -> MatmulPool:
    """The process's MatmulPool, as configure_matmul() last set it."""
    return _active


def configure_matmul(strategy: str, num_threads: int | None) -> MatmulPool:
    """Set the process-wide strategy and pin BLAS to match: "blas" sets the BLAS pool to num_threads
    (None: leaves the BLAS default); "split" runs num_threads slices (None: the usable cores) on
    1-thread BLAS. Call it while no forward runs; returns the new MatmulPool."""
    global _active
    if strategy == "split":
        if num_threads is None:
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threadpool_limits(limits=1, user_api="blas")
        new = MatmulPool("split", num_threads)
    else:
        new = MatmulPool(strategy, num_threads or 1)
        if num_threads is not None:
            threadpool_limits(limits=num_threads, user_api="blas")
    with _lock:
        old, _active = _active, new
    old.close()
    return new


class Q8Matrix:
    """A matrix W [V, K] kept in GGUF Q8_0 blocks (the tied head: the embedding's own bytes, not a
    copy), multiplied as x @ W.T by the compiled kernel (forge/kernels/q8_matmul.c) with W's rows
    split over the pool. Measured against onnxruntime's two 4-bit planes of the same head: 1.5-3x
    faster at 1-8 rows, 2x at 32-64 (docs/benchmarks.md)."""

    nbytes = 0          # the bytes belong to the embedding

    def __init__(self, blocks: npt.NDArray[np.uint8], shape: tuple[int, int]) -> None:
        self._blocks = blocks
        self._rows, self._cols = shape

    @property
    def shape(self) -> tuple[int, int]:
        """[in, out], as the dense weights the model multiplies by on the right."""
        return self._cols, self._rows

    def matmul(self, x: F32) -> F32:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self._rows), dtype=np.float32)                 # [T, V]
        pool = _active
        cuts = _column_cuts(self._rows, pool.num_parts)
        pool.run_parts(lambda cut: products.q8_0_matmul(x, self._blocks, out, cut[0], cut[1]), cuts)
        return out
