"""The block allocator of the paged K/V cache: block ids, block tables, reference counts and the
prefix cache.

Only bookkeeping lives here; the K/V arrays themselves belong to the model runner, which reads
them through the block tables this module hands out. Nothing here knows about models or requests
beyond their sequence ids and token ids.

    block_size = 4                      seq 7: 10 tokens -> 3 blocks, slack 2
    seq 7  [ b5 | b2 | b9 ]             b5 = t0..t3   b2 = t4..t7   b9 = t8 t9 _ _
    seq 8  [ b5 | b1 ]                  shares the full block b5 with seq 7 (ref count 2)

Prefix caching: a full block is identified by the chain of its tokens and all tokens before it.
When a sequence frees a full block, the block keeps its contents and identity on an LRU list of
evictable blocks; a later sequence with the same prefix takes it back instead of recomputing.
Evictable blocks count as free: they are reused (and forgotten) only when the free list is empty.
With `record_events`, each change to the cached set is also a KV event (forge.engine.kv_events) for routers.
A lower `tier` (forge.engine.disk_tier) keeps the blocks forgotten here and brings them back for prompts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from forge.engine.block_files import chain_key, root_key
from forge.engine.block_table import (
    BlockId,
    BlockTable,
    CacheError,
    CacheLayout,
    LowerTier,
    OutOfBlocks,
    SeqId,
    UnknownSequence,
    block_hash,
    divceil,
    salt_root,
)
from forge.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, wire_hash
from forge.messages import BlockAsk, Grant, StepAllocation


@dataclass(slots=True)
class _SeqEntry:
    table: BlockTable
    token_ids: list[int]            # tokens known for prefix hashing (may run ahead of num_tokens)
    num_hashed_blocks: int = 0      # leading full blocks already registered in the prefix cache
    last_hash: int | None = None    # chain hash of the last registered block (at first: the salt's root)
    last_key: bytes = b""           # its stable key (block_files.chain_key), with a lower tier only


MISS_REASONS = ("partial_block", "evicted", "new")


class BlockAllocator:
    """Allocates fixed-size blocks to sequences. Invariant: free + used = total, always."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 record_events: bool = False) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if num_blocks < 0:
            raise ValueError("num_blocks must not be negative")
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._free: deque[BlockId] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._seqs: dict[SeqId, _SeqEntry] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._evictable: OrderedDict[BlockId, None] = OrderedDict()  # ref 0, still cached; LRU first
        self._hash_of: dict[BlockId, tuple[int, tuple[int, ...], bytes]] = {}  # block -> (chain hash, tokens, key)
        self._block_of: dict[int, BlockId] = {}                          # chain hash -> block
        self.num_prefix_queries = 0   # tokens looked up in the prefix cache
        self.num_prefix_hits = 0      # of which found
        # Of the rest, by reason: past the last full block (never cached: a block is cached whole),
        # in a block that was cached once but evicted since, or never cached.
        self.num_prefix_misses = dict.fromkeys(MISS_REASONS, 0)
        self._evicted: OrderedDict[int, None] = OrderedDict()            # keys evicted lately (bounded)
        self._events: list[KVEvent] | None = [] if record_events else None  # since the last take_events
        self.tier: LowerTier | None = None    # where forgotten blocks go (chain keys are kept only with one)

    def layout(self) -> CacheLayout:
        return CacheLayout(self._num_blocks, self._block_size, self.enable_prefix_caching)

    # ---- blocks and sequences ------------------------------------------------------------

    def block_size(self) -> int:
        return self._block_size

    def total_blocks(self) -> int:
        return self._num_blocks

    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def used_blocks(self) -> int:
        return self._num_blocks - self.free_blocks()

    def blocks_needed_for(self, seq: SeqId, extra_tokens: int) -> int:
        """New blocks `seq` needs to hold `extra_tokens` more tokens (an unknown sequence holds none)."""
        entry = self._seqs.get(seq)
        table = entry.table if entry else BlockTable()
        return max(0, divceil(table.num_tokens + extra_tokens, self._block_size) - len(table.blocks))

    def append(self, seq: SeqId, count: int) -> None:
        """Make room for `count` more tokens. Transactional: on OutOfBlocks nothing changes."""
        entry = self._seqs.get(seq)
        if entry is None:
            raise UnknownSequence(seq)
        needed = self.blocks_needed_for(seq, count)
        if needed > self.free_blocks():
            raise OutOfBlocks(needed, self.free_blocks())
        for _ in range(needed):
            entry.table.blocks.append(self._take_block())
        entry.table.num_tokens += count

    def free(self, seq: SeqId) -> None:
        """Release every block of `seq`. Idempotent: freeing an unknown sequence does nothing."""
        entry = self._seqs.pop(seq, None)
        if entry is None:
            return
        if self.enable_prefix_caching:
            self._register_full_blocks(entry)
        for block in reversed(entry.table.blocks):  # tail first: the LRU evicts a chain's end first
            self.release(block)

    def block_table(self, seq: SeqId) -> BlockTable | None:
        entry = self._seqs.get(seq)
        return entry.table if entry else None

    def sequences(self) -> list[SeqId]:
        return list(self._seqs)

    # ---- prefix caching -----------------------------------------------------------------

    def admit_with_prefix(self, seq: SeqId, token_ids: Sequence[int], cache_salt: str | None = None, *,
                          lookup: bool = True) -> int:
        """Admit `seq` knowing its tokens; share cached full blocks of its prefix (only with sequences
        of the same `cache_salt`).

        Returns how many leading tokens are already in the cache. At least one token is always
        left to compute, so that the step that resumes the sequence produces its next logits.
        `lookup` False: nothing is shared (every token is computed), but its blocks are cached as usual.
        """
        if seq in self._seqs:
            raise CacheError(f"sequence {seq} is already admitted")
        root = salt_root(cache_salt)
        entry = _SeqEntry(BlockTable(), list(token_ids), last_hash=root,
                          last_key=root_key(cache_salt) if self.tier is not None else b"")
        self._seqs[seq] = entry
        if not self.enable_prefix_caching or not lookup:
            return 0
        bs = self._block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        self.num_prefix_queries += len(token_ids)
        parent = root
        missed: str | None = None
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            block = self._block_of.get(h)
            if block is None or self._hash_of[block][1] != chunk:
                missed = "evicted" if h in self._evicted else "new"
                break
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            entry.table.blocks.append(block)
            parent = h
        num_cached = len(entry.table.blocks) * bs
        entry.table.num_tokens = num_cached
        entry.num_hashed_blocks = len(entry.table.blocks)
        entry.last_hash = parent
        if entry.table.blocks:
            entry.last_key = self._hash_of[entry.table.blocks[-1]][2]
        self.num_prefix_hits += num_cached
        if missed is not None:
            self.num_prefix_misses[missed] += max_blocks * bs - num_cached
        self.num_prefix_misses["partial_block"] += len(token_ids) - max_blocks * bs
        return num_cached

    def extend_tokens(self, seq: SeqId, token_ids: Iterable[int]) -> None:
        """Tell the cache the tokens that follow those it knows, for prefix hashing."""
        entry = self._seqs.get(seq)
        if entry is None:
            raise UnknownSequence(seq)
        entry.token_ids.extend(token_ids)

    def commit_computed(self, seq: SeqId) -> None:
        """The K/V of every allocated token of `seq` are now computed: cache its full blocks."""
        entry = self._seqs.get(seq)
        if entry is None:
            raise UnknownSequence(seq)
        if self.enable_prefix_caching:
            self._register_full_blocks(entry)

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Keep only the first `num_tokens` slots of `seq` (never more than it holds, never below its
        registered prefix blocks); blocks left wholly unused go back to the free list."""
        entry = self._seqs.get(seq)
        if entry is None:
            raise UnknownSequence(seq)
        table = entry.table
        keep = max(min(num_tokens, table.num_tokens), entry.num_hashed_blocks * self._block_size)
        table.num_tokens = keep
        while len(table.blocks) > divceil(keep, self._block_size):
            self.release(table.blocks.pop())

    def flush_prefix_cache(self) -> int:
        """Forget every cached block: those no sequence holds go back to the free list, those in use
        stay with their sequences but are never shared again. Returns how many blocks were forgotten.
        Sequences keep what they hold; only later prompts lose their hits."""
        num = len(self._hash_of)
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._evicted.clear()
        return num

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call, oldest first: replayed onto an empty set, cached_keys."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def cached_keys(self) -> set[int]:      # every cached block's chain key (as wire hashes), in use or not
        return {wire_hash(h) for h in self._block_of}

    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def _register_full_blocks(self, entry: _SeqEntry) -> None:
        bs = self._block_size
        num_full = min(entry.table.num_tokens, len(entry.token_ids)) // bs
        parent, key = entry.last_hash, entry.last_key
        for i in range(entry.num_hashed_blocks, num_full):
            chunk = tuple(entry.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            key = chain_key(key, chunk) if self.tier is not None else b""
            self.adopt(entry.table.blocks[i], h, chunk, key, parent)
            parent = h
        if num_full > entry.num_hashed_blocks:
            entry.num_hashed_blocks = num_full
            entry.last_hash, entry.last_key = parent, key

    def adopt(self, block: BlockId, h: int, chunk: tuple[int, ...], key: bytes, parent: int | None) -> bool:
        """Cache `block` (computed, or brought back by the tier) as key `h`; False if either is cached already."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = (h, chunk, key)
        if self._events is not None:
            self._events.append(BlockStored(block_hashes=(wire_hash(h),), token_ids=chunk, block_size=self._block_size,
                                            parent_block_hash=None if parent is None else wire_hash(parent)))
        return True

    def cached_prefix(self, token_ids: Sequence[int], cache_salt: str | None) -> tuple[int, int | None, bytes]:
        """Leading full blocks of `token_ids` cached (none taken), the last one's chain hash and key (or roots)."""
        bs, parent, key, num = self._block_size, salt_root(cache_salt), root_key(cache_salt), 0
        while (num + 1) * bs <= len(token_ids):
            chunk = tuple(token_ids[num * bs:(num + 1) * bs])
            block = self._block_of.get(h := block_hash(parent, chunk))
            if block is None or self._hash_of[block][1] != chunk:
                break
            parent, key, num = h, self._hash_of[block][2], num + 1
        return num, parent, key

    def cached_blocks(self) -> list[tuple[BlockId, bytes, tuple[int, ...]]]:
        """Every cached block (block, key, tokens): those in use first, then the rest, most recently used first."""
        held = [b for b in self._hash_of if b not in self._evictable]
        return [(b, self._hash_of[b][2], self._hash_of[b][1]) for b in held + list(reversed(self._evictable))]

    # ---- one engine step ----------------------------------------------------------------

    def allocate_step(self, asks: Sequence[BlockAsk], admit_budget: int | None = None, *,
                      flush: bool = False) -> StepAllocation:
        """Grant blocks for one step, in the asks' priority order.

        A running sequence that cannot get its blocks takes them from the lowest-priority running
        sequence (the last running ask), which is preempted: freed, to be recomputed later; it may
        be the asking sequence itself. A waiting sequence is admitted only while blocks remain,
        nothing was preempted this step and `admit_budget` (tokens computed by all the admitted,
        after their prefix-cache hits; None: no limit) is not spent; admission stops at the first
        that does not fit, in the order given. `flush`: the prefix cache is forgotten first
        (flush_prefix_cache; the count is StepAllocation.num_flushed).
        """
        grants: list[Grant] = []
        preempted: list[SeqId] = []
        num_flushed = self.flush_prefix_cache() if flush else 0
        if self.tier is not None:
            self.tier.collect(self)
        victims = [a.seq_id for a in asks if a.is_running]            # lowest priority last
        budget = admit_budget if admit_budget is not None else 1 << 62
        for ask in asks:
            seq = ask.seq_id
            if seq in preempted:
                continue
            if ask.is_running:
                if ask.num_computed is not None:
                    self.truncate(seq, ask.num_computed)              # rejected drafts' slots back
                self.commit_computed(seq)                             # last step's K/V are written
                self.extend_tokens(seq, ask.new_token_ids)
                num_cached = 0
            else:
                if preempted or budget <= 0:
                    break
                tier = self.tier if self.enable_prefix_caching and ask.use_prefix_cache else None
                if tier is not None and tier.fetch(self, seq, ask.new_token_ids, ask.cache_salt):
                    break                                             # its blocks are coming in: not yet
                num_cached = self.admit_with_prefix(seq, ask.new_token_ids, ask.cache_salt,
                                                    lookup=ask.use_prefix_cache)
                if tier is not None:
                    tier.admitted(self, seq, num_cached, len(ask.new_token_ids))
            entry = self._seqs[seq]
            start = entry.table.num_tokens
            num = min(ask.max_compute, len(entry.token_ids) - start)
            if not ask.is_running:
                num = min(num, budget)
            needed = self.blocks_needed_for(seq, num)
            if needed > self.free_blocks() and not ask.is_running:
                self.free(seq)                                        # not this step; keep the order
                break
            if not ask.is_running:
                budget -= num
            while needed > self.free_blocks():
                victim = victims.pop()
                self.free(victim)
                preempted.append(victim)
                if victim == seq:
                    break
            if seq in preempted:
                continue
            self.append(seq, num)
            grants.append(Grant(seq_id=seq, num_cached=num_cached, start=start, num_tokens=num,
                                block_ids=tuple(entry.table.blocks)))
        # Draft slots last, from the blocks nobody above needed: speculation never preempts or
        # holds back anyone.
        lookahead = {a.seq_id: a.num_lookahead for a in asks if a.is_running and a.num_lookahead}
        for i, grant in enumerate(grants):
            want = lookahead.get(grant.seq_id, 0)
            entry = self._seqs[grant.seq_id]
            if (want and grant.num_tokens and grant.start + grant.num_tokens == len(entry.token_ids)
                    and self.blocks_needed_for(grant.seq_id, want) <= self.free_blocks()):
                self.append(grant.seq_id, want)
                grants[i] = Grant(seq_id=grant.seq_id, num_cached=0, start=grant.start, num_tokens=grant.num_tokens,
                                  block_ids=tuple(entry.table.blocks), num_lookahead=want)
        return StepAllocation(grants=tuple(grants), preempted=tuple(preempted), num_free_blocks=self.free_blocks(),
                              num_total_blocks=self._num_blocks, num_flushed=num_flushed)

    # ---- blocks -------------------------------------------------------------------------

    def take_blocks(self, num: int) -> list[BlockId]:
        """`num` blocks held by no sequence (reference count 1 each: release() gives each back)."""
        if num > self.free_blocks():
            raise OutOfBlocks(num, self.free_blocks())
        return [self._take_block() for _ in range(num)]

    def _take_block(self) -> BlockId:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)   # least recently used cached block
            h, chunk, key = self._hash_of.pop(block)
            del self._block_of[h]
            if self.tier is not None:
                self.tier.evicted(block, key, chunk)
            if self._events is not None:
                self._events.append(BlockRemoved(block_hashes=(wire_hash(h),)))
            self._evicted[h] = None                           # remembered to name later misses
            if len(self._evicted) > 4 * self._num_blocks:
                self._evicted.popitem(last=False)
        self._ref[block] = 1
        return block

    def release(self, block: BlockId) -> None:
        """Give back one reference to `block` (of a sequence's, or one take_blocks took)."""
        self._ref[block] -= 1
        if self._ref[block] > 0:
            return
        if block in self._hash_of:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def ref_count(self, block: BlockId) -> int:
        return self._ref[block]

    def block_map(self) -> str:
        """Every block's state, one character per block id: '.' free, 'c' cached (unreferenced,
        evictable), 'u' used by one sequence, 's' shared by several. What the dashboard draws."""
        states = ["u" if r == 1 else "s" if r > 1 else "." for r in self._ref]
        for block in self._evictable:
            states[block] = "c"
        return "".join(states)
