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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from forge.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, wire_hash
from forge.errors import ForgeError
from forge.messages import BlockAsk, Grant, StepAllocation

SeqId = int
BlockId = int


class CacheError(ForgeError):
    """Base of the paged cache's errors."""


class OutOfBlocks(CacheError):
    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"out of KV blocks: needed {needed}, free {free}")
        self.needed = needed
        self.free = free


class UnknownSequence(CacheError):
    def __init__(self, seq: SeqId) -> None:
        super().__init__(f"unknown sequence {seq}")
        self.seq = seq


@dataclass(slots=True)
class BlockTable:
    blocks: list[BlockId] = field(default_factory=list)
    num_tokens: int = 0

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size

    def slack(self, block_size: int) -> int:
        return self.capacity(block_size) - self.num_tokens


@dataclass(slots=True)
class _SeqEntry:
    table: BlockTable
    token_ids: list[int]            # tokens known for prefix hashing (may run ahead of num_tokens)
    num_hashed_blocks: int = 0      # leading full blocks already registered in the prefix cache
    last_hash: int | None = None    # chain hash of the last registered block (at first: the salt's root)


def _divceil(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: int | None, chunk: tuple[int, ...]) -> int:
    """The key of a full block of tokens in the prefix cache: its tokens and the key of the block
    before it (None for the first), so equal keys mean equal prefixes (up to hash collisions,
    which the cache checks against the stored tokens)."""
    return hash((parent, chunk))


def salt_root(cache_salt: str | None) -> int | None:
    """The parent key of a sequence's first block: None unsalted; for a salted one, a key of its own,
    so sequences with different salts (tenants) never share a block."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


MISS_REASONS = ("partial_block", "evicted", "new")


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The figures a planner needs about a cache it does not own: they never change after start-up."""
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = False


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
        self._hash_of: dict[BlockId, tuple[int, tuple[int, ...]]] = {}  # block -> (chain hash, its tokens)
        self._block_of: dict[int, BlockId] = {}                          # chain hash -> block
        self.num_prefix_queries = 0   # tokens looked up in the prefix cache
        self.num_prefix_hits = 0      # of which found
        # Of the rest, by reason: past the last full block (never cached: a block is cached whole),
        # in a block that was cached once but evicted since, or never cached.
        self.num_prefix_misses = dict.fromkeys(MISS_REASONS, 0)
        self._evicted: OrderedDict[int, None] = OrderedDict()            # keys evicted lately (bounded)
        self._events: list[KVEvent] | None = [] if record_events else None  # since the last take_events

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
        return max(0, _divceil(table.num_tokens + extra_tokens, self._block_size) - len(table.blocks))

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
            self._release_block(block)

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
        entry = _SeqEntry(BlockTable(), list(token_ids), last_hash=root)
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
        while len(table.blocks) > _divceil(keep, self._block_size):
            self._release_block(table.blocks.pop())

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
        parent = entry.last_hash
        for i in range(entry.num_hashed_blocks, num_full):
            chunk = tuple(entry.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            block = entry.table.blocks[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = (h, chunk)
                if self._events is not None:
                    self._events.append(BlockStored(block_hashes=(wire_hash(h),), token_ids=chunk, block_size=bs,
                                                    parent_block_hash=None if parent is None else wire_hash(parent)))
            parent = h
        if num_full > entry.num_hashed_blocks:
            entry.num_hashed_blocks = num_full
            entry.last_hash = parent

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
                num_cached = self.admit_with_prefix(seq, ask.new_token_ids, ask.cache_salt,
                                                    lookup=ask.use_prefix_cache)
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

    def _take_block(self) -> BlockId:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)   # least recently used cached block
            h, _ = self._hash_of.pop(block)
            del self._block_of[h]
            if self._events is not None:
                self._events.append(BlockRemoved(block_hashes=(wire_hash(h),)))
            self._evicted[h] = None                           # remembered to name later misses
            if len(self._evicted) > 4 * self._num_blocks:
                self._evicted.popitem(last=False)
        self._ref[block] = 1
        return block

    def _release_block(self, block: BlockId) -> None:
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
