"""The Python side of the compiled prefill attention (prefill_attention.c): whether it runs here, the
scratch it needs, and the checked call. forge.models.llama.attention's numpy _prefill is its reference.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.kernels import compiled
from forge.kernels.compiled import KV_TYPE, KVScales, check, ptr, scale_pointers, sinks_at

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# The prefill kernel's key chunk (prefill_attention.c's KC): its scratch holds the gathered keys and
# values, rounded up to it and one more.
PREFILL_KEY_CHUNK = 64


def prefill_scratch_floats(num_keys: int, head_dim: int) -> int:
    """Floats of scratch paged_prefill_attention needs for num_keys keys."""
    chunk = PREFILL_KEY_CHUNK
    return 2 * head_dim * (-(-num_keys // chunk) * chunk + chunk)


def prefill_attention_supports(head_dim: int) -> bool:
    """Whether paged_prefill_attention runs here for this head_dim (the compiled kernels built with
    AVX-512, head_dim a multiple of 16 up to 64)."""
    lib = compiled.library()
    return lib is not None and bool(lib.paged_prefill_attention_supports(head_dim))


def paged_prefill_attention(q: F32, k_cache: npt.NDArray[np.generic], v_cache: npt.NDArray[np.generic],
                            tables: I64, row0: I64, pos0: I64, num_keys: I64, ranges: I64, window: int,
                            scratch: F32, out: F32, scales: KVScales | None = None, fast: bool = False,
                            sinks: F32 | None = None) -> None:
    """Causal attention of chunks of query rows into out (see prefill_attention.c), for segments
    s of one sequence's chunk each: the chunk's row row0[s] is at position pos0[s] (its positions
    consecutive), its keys 0 .. num_keys[s] - 1 (with a sliding `window`, only each row's last
    `window` positions) read through tables[s]; `ranges` [n, 3] holds rows [lo, hi) to compute and
    their segment, a segment's ranges consecutive. q, out [T, nh, hd] float32; the caches
    [num_blocks, block_size, nkv, hd] float32, float16, bfloat16 (uint16 bits) or int8 with
    `scales` (as for paged_decode_attention); scratch at least prefill_scratch_floats(max(num_keys),
    hd); prefill_attention_supports(hd) must hold. `fast`: bfloat16 pairs (AVX-512 BF16), see there.
    `sinks`: as for paged_decode_attention."""
    lib = compiled.library()
    assert lib is not None, "paged_prefill_attention called without the compiled kernels"
    kv_type = KV_TYPE.get(k_cache.dtype)
    if kv_type is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"no paged_prefill_attention for a {k_cache.dtype} / {v_cache.dtype} cache")
    check("paged_prefill_attention", q, np.float32, k_cache, k_cache.dtype, v_cache, k_cache.dtype, tables, np.int64,
          row0, np.int64, pos0, np.int64, num_keys, np.int64, ranges, np.int64, scratch, np.float32, out, np.float32)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_segs = len(row0)
    if (ranges.ndim != 2 or ranges.shape[1] != 3 or out.shape != q.shape or tables.ndim != 2
            or tables.shape[0] != num_segs or pos0.shape != (num_segs,) or num_keys.shape != (num_segs,)
            or (len(ranges) and (int(ranges[:, :2].min()) < 0 or int(ranges[:, :2].max()) > len(q)
                                 or int(ranges[:, 2].min()) < 0 or int(ranges[:, 2].max()) >= num_segs))
            or (num_segs and int(num_keys.max()) > tables.shape[1] * block_size)):
        raise ValueError("paged_prefill_attention: ranges, tables or out disagree with q")
    k_scales, v_scales = scale_pointers("paged_prefill_attention", k_cache, scales)
    rc = lib.paged_prefill_attention(ptr(q), ptr(k_cache), ptr(v_cache), k_scales, v_scales, kv_type,
                                     ptr(tables), tables.shape[1],
                                     ptr(row0), ptr(pos0), ptr(num_keys), ptr(ranges), len(ranges), window,
                                     num_heads, num_kv_heads, head_dim, block_size, ptr(scratch), scratch.size,
                                     ptr(out), int(fast), sinks_at(sinks, num_heads))
    if rc != 0:
        raise ValueError(f"paged_prefill_attention: head_dim {head_dim} or a scratch of {scratch.size} floats is "
                         "beyond the kernel's limits")
