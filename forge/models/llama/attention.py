"""Paged attention over the K/V arrays, by one step's attention plan (forge.models.llama.attention_plan).

Reads the K/V arrays (forge.models.llama.kv_cache) through block tables. Which blocks a sequence owns
is the allocator's business; this module trusts the block tables it is given.

    decode rows (query length 1): split into one part per thread of the process's matmul pool;
                                  fused: each part one call of the compiled kernel (forge.kernels.
                                  compiled), reading K/V in place through the block tables; numpy
                                  (the reference): grouped, gathered into [S, L, nkv, hd], one
                                  batched matmul per group
    prefill chunks (length > 1):  per sequence, causal, query rows tiled to bound the scores; the
                                  tiles dealt into one part per thread too, balanced by cost
    the deterministic numerics:   every row, decode or chunk, by forge.kernels.det_attention (one
                                  algorithm: a row's bits do not depend on its chunk or batch mates)
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from forge.errors import ConfigError
from forge.kernels import compiled, prefill_kernel, products
from forge.kernels.det_attention import det_attention
from forge.models.llama.attention_plan import AttentionPlan, DecodeGroup, FusedDecode, FusedPrefill, PrefillSeq
from forge.models.llama.kv_cache import KV, Scales, Scratch
from forge.models.llama.kv_dtype import INT8_GROUP, hadamard32
from forge.models.llama.linear import active_pool

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

def _exp_shifted_(scores: F32, sinks: F32 | None = None) -> F32:
    """In place over the last axis: scores <- exp(scores - row max); returns the row sums
    [..., 1]. Every row has at least one finite entry. The caller divides the (much smaller)
    product with the values by these sums instead of normalising every score. `sinks` (each
    row's attention sink, broadcast to [..., 1]; gpt-oss): a logit that joins each row's max and
    sum but weighs no value."""
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks)
    scores -= top
    np.exp(scores, out=scores)
    sums: F32 = scores.sum(axis=-1, keepdims=True)  # numpy's stubs type a keepdims sum as Any
    if sinks is not None:
        sums += np.exp(sinks - top)
    return sums


def attend(plan: AttentionPlan, q: F32, k_cache: KV, v_cache: KV, scratch: Scratch | None = None,
           scales: tuple[Scales, Scales] | None = None, fast: bool = False, sinks: F32 | None = None) -> F32:
    """Attention for one layer. q is [T, nh, hd], already rotated and scaled by 1/sqrt(hd);
    k_cache/v_cache are that layer's [num_blocks, block_size, nkv, hd] with this step's K/V
    already written (an int8 cache with its K and V `scales`: it holds them rotated, so the
    queries are rotated first and the outputs after, by H / 32). Returns [T, nh, hd]. The decode
    parts run on the active MatmulPool, the calling thread taking the first; a thread runs its
    part's decode groups, then its prefill tiles (decode part i and prefill part i form job i, on
    scratch part i). `fast`: the compiled prefill kernel's products in bfloat16 pairs (the `fast`
    numerics), where the CPU has them. `sinks` [nh] (gpt-oss): each query head's attention sink, a
    logit in its softmax's denominator that weighs no value."""
    if plan.det is not None:
        return _det_attend(plan, q, k_cache, v_cache, scales, sinks)
    scratch = scratch if scratch is not None else Scratch()
    if scales is not None:
        q = _rotated(q)
    out = np.empty_like(q)                                                               # [T, nh, hd]
    num_jobs = max(len(plan.decode_parts), len(plan.fused_parts), len(plan.prefill_parts))
    jobs = [(plan.decode_parts[i] if i < len(plan.decode_parts) else [],
             plan.fused_parts[i] if i < len(plan.fused_parts) else None,
             plan.prefill_parts[i] if i < len(plan.prefill_parts) else [],
             plan.fused_prefill_parts[i] if i < len(plan.fused_prefill_parts) else None, scratch.part(i))
            for i in range(num_jobs)]
    group = q.shape[1] // k_cache.shape[2]

    def run(job: tuple[list[DecodeGroup], FusedDecode | None, list[PrefillSeq], FusedPrefill | None,
                       Scratch]) -> None:
        groups, fused, prefills, fused_prefill, part_scratch = job
        _decode(groups, q, k_cache, v_cache, part_scratch, out, plan.softcap, scales, sinks)
        if fused is not None:
            scores = part_scratch.get(3, (group * int(fused.context_lens.max()),))
            compiled.paged_decode_attention(q, k_cache, v_cache, fused.rows, fused.block_tables,
                                            fused.context_lens, scores, out, fused.first_keys, plan.softcap,
                                            scales=scales, sinks=sinks)
        if plan.fused_prefill:
            if fused_prefill is not None:
                prefill_kernel.paged_prefill_attention(q, k_cache, v_cache, fused_prefill.tables, fused_prefill.row0,
                                                 fused_prefill.pos0, fused_prefill.num_keys, fused_prefill.ranges,
                                                 plan.window, part_scratch.get(0, (fused_prefill.scratch_floats,)),
                                                 out, scales, fast=fast, sinks=sinks)
            return
        for p in prefills:
            _prefill(p, q, k_cache, v_cache, part_scratch, out, plan.softcap, scales, sinks)

    if plan.pool_decode is not None:
        d = plan.pool_decode
        compiled.paged_decode_attention(q, k_cache, v_cache, d.rows, d.block_tables, d.context_lens, _NO_SCRATCH, out,
                                        d.first_keys, plan.softcap, on_pool=True, scales=scales, sinks=sinks)
    if jobs:
        products.pool_park()      # the kernel pool's spinning worker would take a core from these threads
    active_pool().run_parts(run, jobs)
    if scales is not None:
        return _rotated(out, in_place=True)
    return out


def _det_attend(plan: AttentionPlan, q: F32, k_cache: KV, v_cache: KV, scales: tuple[Scales, Scales] | None,
                sinks: F32 | None) -> F32:
    """The deterministic numerics: every row of the step by forge.kernels.det_attention, on the kernel pool."""
    assert plan.det is not None
    if scales is not None:
        raise ConfigError("the deterministic numerics take a float32, float16 or bfloat16 K/V cache, not int8")
    out = np.empty_like(q)
    det_attention(q, k_cache, v_cache, plan.det.tables, plan.det.segments, out, plan.window, plan.softcap, sinks)
    return out


def _rotated(x: F32, in_place: bool = False) -> F32:
    """x [T, nh, hd] with each run of 32 values multiplied by H / 32 (forge.models.llama.kv_dtype's
    hadamard32; compiled where the kernels are): H / 32 takes queries to an int8 cache's rotated
    keys, and outputs back from its rotated values."""
    if compiled.library() is None:
        return hadamard32(x, 1.0 / INT8_GROUP)
    y = x if in_place and x.flags.c_contiguous else np.array(x, dtype=np.float32, order="C")
    compiled.hadamard32_(y, 1.0 / INT8_GROUP)
    return y


_NO_SCRATCH = np.empty(0, dtype=np.float32)    # the pool's threads keep their own scores buffers


def softcap_(scores: F32, cap: float) -> None:
    """scores <- cap * tanh(scores / cap), in place (Gemma 2's soft-capping of scores and logits)."""
    scores *= np.float32(1.0 / cap)
    np.tanh(scores, out=scores)
    scores *= np.float32(cap)


def _decode(groups: list[DecodeGroup], q: F32, k_cache: KV, v_cache: KV, scratch: Scratch, out: F32,
            softcap: float = 0.0, scales: tuple[Scales, Scales] | None = None, sinks: F32 | None = None) -> None:
    """Attention of one part's decode groups; writes their rows of out [T, nh, hd]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_scales, v_scales = scales if scales is not None else (None, None)
    head_sinks = None if sinks is None else sinks.reshape(1, num_kv_heads, group, 1)            # [1, nkv, g, 1]
    for g in groups:
        num_seqs = len(g.rows)
        kv_shape = (num_seqs, -1, num_kv_heads, head_dim)
        keys = scratch.gather(0, k_cache, g.block_ids, k_scales).reshape(kv_shape)       # [S, L, nkv, hd]
        values = scratch.gather(1, v_cache, g.block_ids, v_scales).reshape(kv_shape)     # [S, L, nkv, hd]
        qg = q[g.rows].reshape(num_seqs, num_kv_heads, group, head_dim)                  # [S, nkv, g, hd]
        # transposed views, not copies: numpy hands each [g, hd] x [hd, L] product to BLAS
        scores = scratch.get(2, (num_seqs, num_kv_heads, group, keys.shape[1]))          # [S, nkv, g, L]
        np.matmul(qg, keys.transpose(0, 2, 3, 1), out=scores)
        if softcap:
            softcap_(scores, softcap)
        scores += g.bias
        sums = _exp_shifted_(scores, head_sinks)                                         # [S, nkv, g, 1]
        o = np.matmul(scores, values.transpose(0, 2, 1, 3))                              # [S, nkv, g, hd]
        o /= sums
        out[g.rows] = o.reshape(num_seqs, num_heads, head_dim)


def _prefill(p: PrefillSeq, q: F32, k_cache: KV, v_cache: KV, scratch: Scratch, out: F32,
             softcap: float = 0.0, scales: tuple[Scales, Scales] | None = None, sinks: F32 | None = None) -> None:
    """Causal attention of one sequence's chunk (those of its tiles in p), tile by tile; writes
    their rows of out [T, nh, hd]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_keys = max(t.num_keys for t in p.tiles)  # a part with the early tiles needs only early keys
    block_ids = p.block_ids[: -(-num_keys // k_cache.shape[1])]
    k_scales, v_scales = scales if scales is not None else (None, None)
    flat_k = scratch.gather(0, k_cache, block_ids, k_scales).reshape(-1, num_kv_heads, head_dim)[:num_keys]
    flat_v = scratch.gather(1, v_cache, block_ids, v_scales).reshape(-1, num_kv_heads, head_dim)[:num_keys]
    keys_t = np.ascontiguousarray(flat_k.transpose(1, 2, 0))                             # [nkv, hd, C]
    values = np.ascontiguousarray(flat_v.transpose(1, 0, 2))                             # [nkv, C, hd]
    for t in p.tiles:
        n = t.hi - t.lo
        # fold the GQA group into the rows of each KV head's matmul: rows ordered (token, group)
        q4 = q[t.lo:t.hi].reshape(n, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)  # [nkv, n, g, hd]
        qt = q4.reshape(num_kv_heads, n * group, head_dim)                               # [nkv, n*g, hd]
        scores = scratch.get(2, (num_kv_heads, n * group, t.num_keys))                  # [nkv, n*g, K]
        np.matmul(qt, keys_t[..., : t.num_keys], out=scores)
        if softcap:
            softcap_(scores, softcap)
        scores4 = scores.reshape(num_kv_heads, n, group, t.num_keys)                     # [nkv, n, g, K]
        assert t.bias is not None, "a tile planned for the compiled kernel"
        scores4[..., t.mask_from:] += t.bias[None, :, None, :]
        row_sinks = None if sinks is None else np.broadcast_to(
            sinks.reshape(num_kv_heads, 1, group), (num_kv_heads, n, group)).reshape(num_kv_heads, n * group, 1)
        sums = _exp_shifted_(scores, row_sinks)                                          # [nkv, n*g, 1]
        o = np.matmul(scores, values[:, : t.num_keys])                                   # [nkv, n*g, hd]
        o /= sums
        out_tile = out[t.lo:t.hi].reshape(n, num_kv_heads, group, head_dim)              # view of out
        out_tile[...] = o.reshape(num_kv_heads, n, group, head_dim).transpose(1, 0, 2, 3)
