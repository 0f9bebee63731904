"""One step's attention plan: which rows attend how, split over the matmul pool's threads.

    decode rows (query length 1): split into one part per thread of the process's matmul pool;
                                  fused: each part one call of the compiled kernel, reading K/V
                                  in place through the block tables; numpy (the reference):
                                  grouped, gathered into [S, L, nkv, hd], one batched matmul per group
    prefill chunks (length > 1):  per sequence, causal, query rows tiled to bound the scores; the
                                  tiles dealt into one part per thread too, balanced by cost

Pure arithmetic on the batch's shapes and positions; forge.models.llama.attention runs the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from forge.kernels import prefill_kernel
from forge.kernels.det_attention import segments as det_segments
from forge.models.forward_batch import ForwardBatch
from forge.models.llama.linear import active_pool
from forge.models.llama.llama_config import LlamaConfig

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# Upper bound on the floats of one temporary (gathered keys, or one tile of scores): 16 MiB.
MAX_TEMP_FLOATS = 1 << 22
# Decode groups gather at most this many floats of keys (and as many of values): 1 MiB each, so a
# group's gathered keys, values and scores stay in a core's L2 cache between the gather and the
# two matmuls that read them. Measured at 32-64 sequences: a little faster than 16 MiB groups.
MAX_DECODE_GATHER_FLOATS = 1 << 18
# Query rows per prefill tile: small enough that a tile skips the keys that lie after all its
# queries (about half of a causal prefill), large enough to keep the matmuls efficient.
MAX_PREFILL_TILE_ROWS = 128
# Decode sequences are split across the matmul pool's threads from this many on (each thread runs
# its own part's groups, on its own scratch buffers; rows are independent, so results match).
MIN_PARALLEL_DECODE_SEQS = 2
# Prefill work is split across the pool's threads from this cost on (query rows x visible keys,
# summed over the step's tiles; 4096 is about 0.1 ms of attention per layer at 135M, a guess at
# where a thread hand-off stops paying, not measured).
MIN_PARALLEL_PREFILL_COST = 1 << 12


@dataclass(slots=True)
class DecodeGroup:
    rows: I64       # [S]          token rows of T, one per sequence
    block_ids: I64  # [S, nb]      the blocks to gather (padding entries are masked)
    bias: F32       # [S, 1, 1, L] 0 where a key is visible, -inf elsewhere; L = nb * block_size


@dataclass(slots=True)
class FusedDecode:
    """One part's decode rows for the compiled kernel: each reads its keys in place."""
    rows: I64          # [S]     token rows of T
    block_tables: I64  # [S, W]  C-contiguous
    context_lens: I64  # [S]
    first_keys: I64 | None = None  # [S] each row's first visible key (a sliding window); None: 0


@dataclass(slots=True)
class PrefillTile:
    lo: int         # first token row of T
    hi: int         # one past the last
    num_keys: int   # keys the tile can see at all: its last position + 1
    mask_from: int  # keys before this one are visible to every query of the tile
    bias: F32 | None  # [hi - lo, num_keys - mask_from]  the causal mask over the rest, 0 / -inf;
                      # None for the compiled kernel, which masks as it goes


@dataclass(slots=True)
class PrefillSeq:
    block_ids: I64  # [nb]
    context_len: int
    tiles: list[PrefillTile]
    row0: int = 0   # the chunk's first row of T
    pos0: int = 0   # its position (the chunk's rows are consecutive positions)


@dataclass(slots=True)
class FusedPrefill:
    """One part's prompt chunks for the compiled kernel, one call per layer: segment s is a chunk
    (or some of its tiles) of one sequence."""
    tables: I64     # [S, W]  block tables
    row0: I64       # [S]     the chunk's first row of T
    pos0: I64       # [S]     its position
    num_keys: I64   # [S]     the keys its rows see at most: the last position + 1
    ranges: I64     # [R, 3]  rows [lo, hi) and their segment, a segment's ranges consecutive
    scratch_floats: int


@dataclass(slots=True)
class DetRows:
    """Every row of a step for the deterministic numerics' attention (det_attention.c), decode rows, prompt
    chunks and guesses alike: one definition, so a row's bits do not depend on which of them it is."""
    tables: I64     # [num_seqs, W]  the step's block tables, C-contiguous
    segments: I64   # [S, 4]  forge.kernels.det_attention.segments


@dataclass(slots=True)
class AttentionPlan:
    """Everything about a step's attention that does not depend on the layer: built once."""

    decode_parts: list[list[DecodeGroup]]  # one list of groups per thread; parts own disjoint rows
    prefill_parts: list[list[PrefillSeq]]  # one list per thread, each sequence once with some of its
                                           # tiles; parts own disjoint rows
    fused_parts: list[FusedDecode] = field(default_factory=list)  # instead of decode_parts, when fused
    softcap: float = 0.0           # scores become softcap * tanh(scores / softcap) before the mask; 0: none
    fused_prefill: bool = False    # prefill chunks by the compiled kernel (forge.kernels.prefill_kernel)
    fused_prefill_parts: list[FusedPrefill | None] = field(default_factory=list)  # per part, when fused_prefill
    window: int = 0                # a sliding window (each query sees its last `window` positions); 0: none
    pool_decode: FusedDecode | None = None  # every fused decode row at once, on the compiled products' pool
    det: DetRows | None = None     # the deterministic numerics: every row by forge.kernels.det_attention instead

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        return [g for part in self.decode_parts for g in part]


def _causal_bias(query_positions: I64, num_keys: int, first_key: int = 0, window: int = 0) -> F32:
    """[n, num_keys - first_key]: key j is visible to the query at position p iff j <= p (and,
    with a sliding window, p - j < window)."""
    keys = np.arange(first_key, num_keys)[None, :]                                     # [1, K]
    visible = keys <= query_positions[:, None]                                         # [n, K]
    if window:
        visible &= keys > query_positions[:, None] - window
    return np.where(visible, np.float32(0.0), np.float32(-np.inf))                     # [n, K]


# Chunks of at most this many query rows go to the compiled decode kernel row by row (fused
# attention) where the compiled prefill kernel cannot run ...
MAX_FUSED_CHUNK_ROWS = 8
# ... and where it can, up to this many: longer chunks (a decode row with its guesses) share one pass
# over the keys in the prefill kernel. Measured (scripts/ab/ab_engine.py guesses; 32 sequences, one
# layer, one thread): prefill/decode kernel 1.55 at 2 rows, 1.25 at 3, 0.95 at 4 and 0.78 at 5
# rows of ~800 keys.
MAX_DECODE_KERNEL_ROWS = 3


def _split_decodes(decode_seqs: I64, num_blocks_needed: I64, num_parts: int) -> list[I64]:
    """Deal the decode sequences into num_parts parts of about equal keys: longest first, each to
    the part with the fewest keys so far (ties to the lower part); deterministic."""
    loads = [0] * num_parts
    members: list[list[int]] = [[] for _ in range(num_parts)]
    for s in decode_seqs[np.argsort(-num_blocks_needed[decode_seqs], kind="stable")]:
        part = loads.index(min(loads))
        loads[part] += int(num_blocks_needed[s])
        members[part].append(int(s))
    return [np.array(m, dtype=np.int64) for m in members if m]


def _tile_cost(t: PrefillTile) -> int:
    return (t.hi - t.lo) * t.num_keys


def _split_prefills(seqs: list[PrefillSeq], num_parts: int, loads: list[int]) -> list[list[PrefillSeq]]:
    """Deal the prefill tiles into num_parts parts of about equal cost (a tile: rows x keys), on top
    of the parts' `loads` so far: whole sequences, except that one costing over half a part's share
    is dealt tile by tile; costliest first, each to the part with the least load (ties to the
    lower part); deterministic. A part holds each sequence it has tiles of once (it gathers that
    sequence's keys once), its tiles in order. Returns exactly num_parts lists, some maybe empty."""
    seq_costs = [sum(_tile_cost(t) for t in p.tiles) for p in seqs]
    total = sum(seq_costs)
    if num_parts < 2 or total < MIN_PARALLEL_PREFILL_COST:
        return [seqs] + [[] for _ in range(num_parts - 1)]
    items: list[tuple[int, int, list[PrefillTile]]] = []  # (cost, sequence index, tiles)
    for i, (p, cost) in enumerate(zip(seqs, seq_costs, strict=True)):
        if cost * 2 * num_parts > total:
            items.extend((_tile_cost(t), i, [t]) for t in p.tiles)
        else:
            items.append((cost, i, p.tiles))
    loads = list(loads)
    taken: list[dict[int, list[PrefillTile]]] = [{} for _ in range(num_parts)]
    for cost, i, tiles in sorted(items, key=lambda item: -item[0]):  # stable
        part = loads.index(min(loads))
        loads[part] += cost
        taken[part].setdefault(i, []).extend(tiles)
    return [[PrefillSeq(seqs[i].block_ids, seqs[i].context_len, sorted(tiles, key=lambda t: t.lo), seqs[i].row0,
                        seqs[i].pos0)
             for i, tiles in sorted(members.items())] for members in taken]


def plan_attention(batch: ForwardBatch, config: LlamaConfig, block_size: int,
                   num_parts: int | None = None, *, fused: bool = False, window: int = 0,
                   softcap: float = 0.0, decode_on_pool: bool = False, det: bool = False) -> AttentionPlan:
    """Split the step into decode parts (num_parts at most; None: one per thread of the active
    MatmulPool), of decode groups or, `fused`, for the compiled kernel, and prefill sequences;
    the batch is assumed validated. With a sliding `window`, each query sees only the keys of its
    last `window` positions; with a `softcap` (Gemma 2's), scores are soft-capped before the mask.
    `decode_on_pool` (fused only): the decode rows as one call that the compiled products' own
    threads split by (row, KV head), so that even one sequence's heads run in parallel and no
    second set of threads competes with theirs (the blocks backend's). `det`: the deterministic numerics,
    every row by the one algorithm of forge.kernels.det_attention, on the kernel pool (the other fields unused)."""
    starts = batch.query_start
    if window and batch.num_tokens and int(batch.positions.max()) < window:
        window = 0                                          # no query reaches past the window
    if det:
        return AttentionPlan([], [], softcap=softcap, window=window, det=DetRows(
            np.ascontiguousarray(batch.block_tables, dtype=np.int64), det_segments(starts, batch.positions)))
    lengths = np.diff(starts)                                                            # [S]
    num_blocks_needed = -(-batch.context_lens // block_size)                             # [S] ceil

    num_parts = max(1, active_pool().num_parts if num_parts is None else num_parts)
    # Prompt chunks by the compiled kernel where it runs (it masks as it goes: no bias to build). It
    # takes every chunk of more than MAX_DECODE_KERNEL_ROWS rows, speculative decoding's guesses
    # included: their rows share one pass over the keys, where the decode kernel reads them per row.
    fused_prefill = fused and not softcap and prefill_kernel.prefill_attention_supports(config.head_dim)
    max_decode_rows = MAX_DECODE_KERNEL_ROWS if fused_prefill else MAX_FUSED_CHUNK_ROWS
    fused_parts: list[FusedDecode] = []
    decode_parts: list[list[DecodeGroup]] = []
    if fused:
        # The compiled kernel takes each query row alone, over the keys up to its own position: a
        # short chunk (a decode row with its draft tokens, a tiny prompt) runs as that many decode
        # rows, reading its keys in place instead of gathering them.
        short = np.flatnonzero(lengths <= max_decode_rows)                               # [S']
        rows = np.repeat(starts[short] - np.cumsum(lengths[short]) + lengths[short], lengths[short]) \
            + np.arange(int(lengths[short].sum()))                                         # [R]
        row_seq = np.repeat(short, lengths[short])                                         # [R]
        row_ctx = batch.positions[rows] + 1                                                # [R]
        num_decode_parts = num_parts if len(rows) >= MIN_PARALLEL_DECODE_SEQS and not decode_on_pool else 1
        row_first = np.maximum(row_ctx - window, 0) if window else None                   # [R]
        fused_parts = [FusedDecode(rows[p], np.ascontiguousarray(batch.block_tables[row_seq[p]]),
                                   np.ascontiguousarray(row_ctx[p]),
                                   None if row_first is None else np.ascontiguousarray(row_first[p]))
                       for p in _split_decodes(np.arange(len(rows)), -(-row_ctx // block_size), num_decode_parts)]
        long_seqs = np.flatnonzero(lengths > max_decode_rows)
    else:
        decode_seqs = np.flatnonzero(lengths == 1)
        num_decode_parts = num_parts if len(decode_seqs) >= MIN_PARALLEL_DECODE_SEQS else 1
        parts = _split_decodes(decode_seqs, num_blocks_needed, num_decode_parts)
        decode_parts = [_decode_groups(seqs, batch, config, block_size, num_blocks_needed, window) for seqs in parts]
        long_seqs = np.flatnonzero(lengths > 1)

    prefills: list[PrefillSeq] = []
    for s in long_seqs:
        ctx = int(batch.context_lens[s])
        lo, hi = int(starts[s]), int(starts[s + 1])
        tile_rows = max(1, min(MAX_PREFILL_TILE_ROWS, MAX_TEMP_FLOATS // (config.num_heads * ctx)))
        tiles: list[PrefillTile] = []
        for t in range(lo, hi, tile_rows):
            positions = batch.positions[t:min(t + tile_rows, hi)]                      # [n]
            num_keys, mask_from = int(positions.max()) + 1, 0 if window else int(positions.min()) + 1
            bias = None if fused_prefill else _causal_bias(positions, num_keys, mask_from, window)  # [n, K - mask_from]
            tiles.append(PrefillTile(t, t + len(positions), num_keys, mask_from, bias))
        prefills.append(PrefillSeq(np.ascontiguousarray(batch.block_tables[s, : int(num_blocks_needed[s])]), ctx,
                                   tiles, lo, int(batch.positions[lo])))
    pool_decode = None
    if decode_on_pool and fused_parts:
        pool_decode, fused_parts = fused_parts[0], []
    # a decode row costs its padded keys, in the same units as a tile: one query row x keys
    if fused:   # a fused row costs its keys, about 4x less per key than a gathered one (measured)
        loads = [int(part.context_lens.sum()) // 4 for part in fused_parts]
    else:
        loads = [sum(len(g.rows) * g.bias.shape[-1] for g in part) for part in decode_parts]
    loads += [0] * (num_parts - len(loads))
    prefill_parts = _split_prefills(prefills, num_parts, loads)
    while prefill_parts and not prefill_parts[-1]:
        prefill_parts.pop()
    fused_prefill_parts = [_fused_prefill(part, config.head_dim) for part in prefill_parts] if fused_prefill else []
    return AttentionPlan(decode_parts, prefill_parts, fused_parts, softcap=softcap, fused_prefill=fused_prefill,
                         fused_prefill_parts=fused_prefill_parts, window=window, pool_decode=pool_decode)


def _fused_prefill(part: list[PrefillSeq], head_dim: int) -> FusedPrefill | None:
    """A part's sequences and tiles as the compiled kernel's arrays."""
    if not part:
        return None
    width = max(len(p.block_ids) for p in part)
    tables = np.zeros((len(part), width), dtype=np.int64)
    for s, p in enumerate(part):
        tables[s, : len(p.block_ids)] = p.block_ids
    num_keys = np.array([max(t.num_keys for t in p.tiles) for p in part], dtype=np.int64)
    ranges = np.array([(t.lo, t.hi, s) for s, p in enumerate(part) for t in p.tiles], dtype=np.int64)
    return FusedPrefill(tables, np.array([p.row0 for p in part], dtype=np.int64),
                        np.array([p.pos0 for p in part], dtype=np.int64), num_keys, ranges,
                        prefill_kernel.prefill_scratch_floats(int(num_keys.max()), head_dim))


def _decode_groups(decode_seqs: I64, batch: ForwardBatch, config: LlamaConfig, block_size: int,
                   num_blocks_needed: I64, window: int = 0) -> list[DecodeGroup]:
    """Group one part's decode sequences by length, each group's gathered keys under the budget."""
    starts = batch.query_start
    kv_width = config.num_kv_heads * config.head_dim
    group_budget = min(MAX_TEMP_FLOATS, MAX_DECODE_GATHER_FLOATS)
    decode_seqs = decode_seqs[np.argsort(batch.context_lens[decode_seqs], kind="stable")]  # by length
    groups: list[DecodeGroup] = []
    begin = 0
    while begin < len(decode_seqs):
        end = begin + 1  # grow while the gathered keys stay under the budget (lengths ascend)
        while end < len(decode_seqs):
            num_keys = int(num_blocks_needed[decode_seqs[end]]) * block_size
            if (end + 1 - begin) * num_keys * max(kv_width, config.num_heads) > group_budget:
                break
            end += 1
        seqs = decode_seqs[begin:end]
        nb = int(num_blocks_needed[seqs].max())
        rows = starts[seqs]                                                              # [S]
        bias = _causal_bias(batch.positions[rows], nb * block_size, window=window)      # [S, L]
        groups.append(DecodeGroup(rows, batch.block_tables[seqs, :nb], bias[:, None, None, :]))
        begin = end
    return groups
