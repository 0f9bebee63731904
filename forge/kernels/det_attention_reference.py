"""det_attention.c's definition in numpy: the deterministic numerics' attention of one query row, the same
float32 operations in the same order (each rounded once, no fused multiply-add), so the same bits as every
build of the compiled kernel (the tests compare them). Slow: a definition, not a path the engine runs.

Per query row (head h at position p, scaled as the model passes it; its KV head h // group) over the keys
j = f .. p it sees (f = 0, or p - window + 1 with a sliding window), widened exactly to float32:
s_j = sum over d in order of q_d * k_jd; soft-capped (Gemma 2) as a = s / c ... ; m = max(s_j, sink);
e_j = det_exp(s_j - m); l = the fixed tree over sixteen partials by j mod 16 (+ det_exp(sink - m));
o = (sum over j ascending of e_j * v_j) / l. det_attention.c's header comment says it in full.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.kernels.det_math import det_exp

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
TILE = 16


def widened(cache: npt.NDArray[np.generic]) -> F32:
    """A K/V cache's values as float32, exactly (uint16: bfloat16 bits)."""
    if cache.dtype == np.uint16:
        out: F32 = (cache.astype(np.uint32) << 16).view(np.float32)
        return out
    if cache.dtype not in (np.float32, np.float16):
        raise ValueError(f"the deterministic attention takes float32, float16 or bfloat16 caches, not {cache.dtype}")
    return cache.astype(np.float32)


def softcapped(s: F32, cap: float) -> F32:
    """The definition's soft-capping: cap * tanh(s / cap), tanh(a) as 1 - 2 / (det_exp(2a) + 1)."""
    c = np.float32(cap)
    a = (s * (np.float32(1) / c)).astype(np.float32)
    t = det_exp((a + a).astype(np.float32))
    th = (np.float32(1) - np.float32(2) / (t + np.float32(1))).astype(np.float32)
    out: F32 = (th * c).astype(np.float32)
    return out


def attend_row(q: F32, keys: F32, values: F32, first: int, softcap: float = 0.0, sink: float | None = None) -> F32:
    """One query row q [hd] over keys/values [n, hd] (float32; key i is position first + i): its output [hd]."""
    s = np.zeros(len(keys), dtype=np.float32)
    for d in range(q.shape[0]):
        s = (s + (q[d] * keys[:, d]).astype(np.float32)).astype(np.float32)
    if softcap:
        s = softcapped(s, softcap)
    m = np.float32(s.max())
    if sink is not None and np.float32(sink) > m:
        m = np.float32(sink)
    e = det_exp((s - m).astype(np.float32))
    first_tile = first // TILE * TILE
    padded = np.zeros(-(-(first + len(e) - first_tile) // TILE) * TILE, dtype=np.float32)
    padded[first - first_tile:first - first_tile + len(e)] = e
    p = np.zeros(TILE, dtype=np.float32)
    for tile in padded.reshape(-1, TILE):                  # partial k: the e_j with j = k (mod 16), j ascending
        p = (p + tile).astype(np.float32)
    half = TILE // 2
    while half:
        p[:half] = (p[:half] + p[half:2 * half]).astype(np.float32)
        half //= 2
    total = np.float32(p[0])
    if sink is not None:
        total = np.float32(total + det_exp(np.array([np.float32(sink) - m], dtype=np.float32))[0])
    o = np.zeros(q.shape[0], dtype=np.float32)
    for j in range(len(e)):
        o = (o + (e[j] * values[j]).astype(np.float32)).astype(np.float32)
    out: F32 = (o / total).astype(np.float32)
    return out


def det_attention_reference(q: F32, k_cache: npt.NDArray[np.generic], v_cache: npt.NDArray[np.generic],
                            block_tables: I64, segments: I64, window: int = 0, softcap: float = 0.0,
                            sinks: F32 | None = None) -> F32:
    """The definition over det_attention.c's arguments: q [T, nh, hd]; caches [num_blocks, block_size, nkv,
    hd]; segments [S, 4] (block-table row, first row of q, rows, first row's position). Returns [T, nh, hd],
    zero in the rows no segment names."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k, v = widened(k_cache), widened(v_cache)
    out = np.zeros_like(q)
    for table_row, row0, rows, pos0 in segments.tolist():
        table = block_tables[table_row]
        for i in range(rows):
            pos = pos0 + i
            first = max(0, pos + 1 - window) if window else 0
            slots = np.arange(first, pos + 1)
            blocks, offsets = table[slots // block_size], slots % block_size
            for h in range(num_heads):
                g = h // group
                out[row0 + i, h] = attend_row(q[row0 + i, h], k[blocks, offsets, g], v[blocks, offsets, g], first,
                                              softcap, None if sinks is None else float(sinks[h]))
    return out
