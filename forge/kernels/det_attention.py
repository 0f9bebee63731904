"""The deterministic numerics' attention (det_attention.c) from Python: every query row of a step, decode rows,
prompt chunks and guesses alike, by one definition (forge.kernels.det_attention_reference), so a row's output
has the same bits whatever its batch mates, its chunk, the threads and the build level."""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

from forge.kernels.compiled import KV_TYPE, check, library, ptr, sinks_at

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# A prompt chunk is cut into segments of at most this many rows: a segment's rows share its widened keys and
# values (read once per KV head), and segments spread a chunk over the kernel pool's threads.
SEGMENT_ROWS = 32


def segments(query_start: I64, positions: I64, rows: int = SEGMENT_ROWS) -> I64:
    """[S, 4]: each sequence's rows (query_start [num_seqs + 1]; their positions consecutive from
    positions[query_start[s]]) cut into runs of at most `rows`: block-table row, first row, rows, first position."""
    out: list[tuple[int, int, int, int]] = []
    for s in range(len(query_start) - 1):
        lo, hi = int(query_start[s]), int(query_start[s + 1])
        for r in range(lo, hi, rows):
            out.append((s, r, min(rows, hi - r), int(positions[r])))
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def det_attention(q: F32, k_cache: npt.NDArray[np.generic], v_cache: npt.NDArray[np.generic], block_tables: I64,
                  segs: I64, out: F32, window: int = 0, softcap: float = 0.0, sinks: F32 | None = None,
                  lib: ctypes.CDLL | None = None, parallel: bool = True) -> None:
    """det_attention.c over the segments' rows into out (see det_attention_reference for the arguments): q, out
    [T, nh, hd] float32; caches float32, float16 or bfloat16 (uint16 bits). Every array C-contiguous (checked).
    `lib`: another level's build (compiled.library_at), else the process's; `parallel`: on the kernel pool."""
    lib = lib or library()
    assert lib is not None, "det_attention called without the compiled kernels"
    kv_type = KV_TYPE.get(k_cache.dtype)
    if kv_type is None or kv_type > 2 or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"the deterministic attention takes float32, float16 or bfloat16 caches, not {k_cache.dtype}")
    check("det_attention", q, np.float32, out, np.float32, k_cache, k_cache.dtype, v_cache, k_cache.dtype,
          block_tables, np.int64, segs, np.int64)
    if out.shape != q.shape or segs.ndim != 2 or segs.shape[1] != 4 or block_tables.ndim != 2:
        raise ValueError("det_attention needs out shaped as q, segments [S, 4] and block tables [N, W]")
    num_heads, head_dim = q.shape[1:]
    if len(segs):
        ends = segs[:, 3] + segs[:, 2]                              # one past each segment's last position
        if (int(segs[:, 0].min()) < 0 or int(segs[:, 0].max()) >= len(block_tables) or int(segs[:, 1].min()) < 0
                or int((segs[:, 1] + segs[:, 2]).max()) > len(q) or int(segs[:, 2].min()) < 1
                or int(segs[:, 3].min()) < 0 or int(ends.max()) > block_tables.shape[1] * k_cache.shape[1]):
            raise ValueError("det_attention: a segment lies outside q or its block table")
    rc = lib.forge_det_attention(ptr(q), ptr(k_cache), ptr(v_cache), kv_type, ptr(block_tables),
                                 block_tables.shape[1], ptr(segs), len(segs), num_heads, k_cache.shape[2], head_dim,
                                 k_cache.shape[1], window, softcap, sinks_at(sinks, num_heads), ptr(out),
                                 int(parallel))
    if rc == -2:
        raise MemoryError("det_attention: no memory for a thread's buffers")
    if rc != 0:
        raise ValueError(f"det_attention: {num_heads // k_cache.shape[2]} query heads per KV head or head_dim "
                         f"{head_dim} is beyond the kernel's limits (64, 512)")
