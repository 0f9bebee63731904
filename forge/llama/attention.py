"""Paged attention over the K/V arrays: the KVCache storage and one step's attention plan.

Owns the K/V arrays ([num_layers, num_blocks, block_size, num_kv_heads, head_dim], preallocated
once) and reading them through block tables. Which blocks a sequence owns is the allocator's
business; this module trusts the block tables it is given.

    decode rows (query length 1): grouped, gathered into [S, L, nkv, hd], one batched matmul
    prefill chunks (length > 1):  per sequence, causal, query rows tiled to bound the scores
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.batch import ForwardBatch
from forge.llama.config import LlamaConfig

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# Upper bound on the floats of one temporary (gathered keys, or one tile of scores): 16 MiB.
MAX_TEMP_FLOATS = 1 << 22
# Query rows per prefill tile: small enough that a tile skips the keys that lie after all its
# queries (about half of a causal prefill), large enough to keep the matmuls efficient.
MAX_PREFILL_TILE_ROWS = 128


class KVCache:
    """The K and V arrays of every layer; a flat slot is block_id * block_size + offset."""

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # zeros, not empty: padded reads multiply stale slots by probability 0, which needs finite values
        self.k: F32 = np.zeros(shape, dtype=np.float32)
        self.v: F32 = np.zeros(shape, dtype=np.float32)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: LlamaConfig, block_size: int) -> int:
        """Bytes one block costs across all layers, K and V together (float32)."""
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * 4

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(slots=True)
class DecodeGroup:
    rows: I64       # [S]          token rows of T, one per sequence
    block_ids: I64  # [S, nb]      the blocks to gather (padding entries are masked)
    bias: F32       # [S, 1, 1, L] 0 where a key is visible, -inf elsewhere; L = nb * block_size


@dataclass(slots=True)
class PrefillTile:
    lo: int         # first token row of T
    hi: int         # one past the last
    num_keys: int   # keys the tile can see at all: its last position + 1
    mask_from: int  # keys before this one are visible to every query of the tile
    bias: F32       # [hi - lo, num_keys - mask_from]  the causal mask over the rest, 0 / -inf


@dataclass(slots=True)
class PrefillSeq:
    block_ids: I64  # [nb]
    context_len: int
    tiles: list[PrefillTile]


@dataclass(slots=True)
class AttentionPlan:
    """Everything about a step's attention that does not depend on the layer: built once."""

    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]


def _causal_bias(query_positions: I64, num_keys: int, first_key: int = 0) -> F32:
    """[n, num_keys - first_key]: key j is visible to the query at position p iff j <= p."""
    visible = np.arange(first_key, num_keys)[None, :] <= query_positions[:, None]      # [n, K]
    return np.where(visible, np.float32(0.0), np.float32(-np.inf))                     # [n, K]


def plan_attention(batch: ForwardBatch, config: LlamaConfig, block_size: int) -> AttentionPlan:
    """Split the step into decode groups and prefill sequences; the batch is assumed validated."""
    starts = batch.query_start
    lengths = np.diff(starts)                                                            # [S]
    num_blocks_needed = -(-batch.context_lens // block_size)                             # [S] ceil
    kv_width = config.num_kv_heads * config.head_dim

    decode_seqs = np.flatnonzero(lengths == 1)
    decode_seqs = decode_seqs[np.argsort(batch.context_lens[decode_seqs], kind="stable")]  # by length
    groups: list[DecodeGroup] = []
    begin = 0
    while begin < len(decode_seqs):
        end = begin + 1  # grow while the gathered keys stay under the budget (lengths ascend)
        while end < len(decode_seqs):
            num_keys = int(num_blocks_needed[decode_seqs[end]]) * block_size
            if (end + 1 - begin) * num_keys * max(kv_width, config.num_heads) > MAX_TEMP_FLOATS:
                break
            end += 1
        seqs = decode_seqs[begin:end]
        nb = int(num_blocks_needed[seqs].max())
        rows = starts[seqs]                                                              # [S]
        bias = _causal_bias(batch.positions[rows], nb * block_size)                      # [S, L]
        groups.append(DecodeGroup(rows, batch.block_tables[seqs, :nb], bias[:, None, None, :]))
        begin = end

    prefills: list[PrefillSeq] = []
    for s in np.flatnonzero(lengths > 1):
        ctx = int(batch.context_lens[s])
        lo, hi = int(starts[s]), int(starts[s + 1])
        tile_rows = max(1, min(MAX_PREFILL_TILE_ROWS, MAX_TEMP_FLOATS // (config.num_heads * ctx)))
        tiles: list[PrefillTile] = []
        for t in range(lo, hi, tile_rows):
            positions = batch.positions[t:min(t + tile_rows, hi)]                      # [n]
            num_keys, mask_from = int(positions.max()) + 1, int(positions.min()) + 1
            bias = _causal_bias(positions, num_keys, mask_from)                          # [n, K - mask_from]
            tiles.append(PrefillTile(t, t + len(positions), num_keys, mask_from, bias))
        prefills.append(PrefillSeq(batch.block_tables[s, : int(num_blocks_needed[s])], ctx, tiles))
    return AttentionPlan(groups, prefills)


def _softmax_(scores: F32) -> None:
    """In place over the last axis; every row has at least one finite entry."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


def attend(plan: AttentionPlan, q: F32, k_cache: F32, v_cache: F32) -> F32:
    """Attention for one layer. q is [T, nh, hd], already rotated and scaled by 1/sqrt(hd);
    k_cache/v_cache are that layer's [num_blocks, block_size, nkv, hd] with this step's K/V
    already written. Returns [T, nh, hd]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = np.empty_like(q)                                                               # [T, nh, hd]
    for g in plan.decode_groups:
        num_seqs = len(g.rows)
        keys = k_cache[g.block_ids].reshape(num_seqs, -1, num_kv_heads, head_dim)        # [S, L, nkv, hd]
        values = v_cache[g.block_ids].reshape(num_seqs, -1, num_kv_heads, head_dim)      # [S, L, nkv, hd]
        qg = q[g.rows].reshape(num_seqs, num_kv_heads, group, head_dim)                  # [S, nkv, g, hd]
        scores = np.matmul(qg, keys.transpose(0, 2, 3, 1))                               # [S, nkv, g, L]
        scores += g.bias
        _softmax_(scores)
        o = np.matmul(scores, values.transpose(0, 2, 1, 3))                              # [S, nkv, g, hd]
        out[g.rows] = o.reshape(num_seqs, num_heads, head_dim)
    for p in plan.prefills:
        flat_k = k_cache[p.block_ids].reshape(-1, num_kv_heads, head_dim)[: p.context_len]  # [C, nkv, hd]
        flat_v = v_cache[p.block_ids].reshape(-1, num_kv_heads, head_dim)[: p.context_len]  # [C, nkv, hd]
        keys_t = flat_k.transpose(1, 2, 0)                                               # [nkv, hd, C]
        values = np.ascontiguousarray(flat_v.transpose(1, 0, 2))                         # [nkv, C, hd]
        for t in p.tiles:
            n = t.hi - t.lo
            # fold the GQA group into the rows of each KV head's matmul: rows ordered (token, group)
            qt = q[t.lo:t.hi].reshape(n, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
            qt = qt.reshape(num_kv_heads, n * group, head_dim)                           # [nkv, n*g, hd]
            scores = np.matmul(qt, keys_t[..., : t.num_keys])                             # [nkv, n*g, K]
            scores = scores.reshape(num_kv_heads, n, group, t.num_keys)                  # [nkv, n, g, K]
            scores[..., t.mask_from:] += t.bias[None, :, None, :]
            _softmax_(scores)
            o = np.matmul(scores.reshape(num_kv_heads, n * group, -1), values[:, : t.num_keys])  # [nkv, n*g, hd]
            out_tile = out[t.lo:t.hi].reshape(n, num_kv_heads, group, head_dim)          # view of out
            out_tile[...] = o.reshape(num_kv_heads, n, group, head_dim).transpose(1, 0, 2, 3)
    return out
