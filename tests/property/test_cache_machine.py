"""State machine over the paged cache: blocks are conserved, counted and never owned twice, and the
prefix cache hands out only blocks that hold the tokens asked for.

The machine drives the cache's whole surface against a shadow model: admit/append/free/evict on bare
sequences, and allocate_step (asks built the way forge/engine/scheduler.py builds them), free and
admit_with_prefix on prompt sequences, with the prefix cache on or off (drawn per run). The shadow
records which token each block slot holds as grants compute them, so a prefix hit is checked against
what was written into its blocks, not against the cache's own bookkeeping.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
import msgspec
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from forge.messages import BlockAsk
from forge.seed.paged_cache import OutOfBlocks, PagedKVCache

NUM_BLOCKS = 8
BLOCK_SIZE = 4
FIRST_PROMPT_ID = 100         # prompt sequences' ids, apart from the bare ones (0..8)
TOKENS = st.integers(0, 2)    # a small alphabet, so that prompts share full blocks often
# A prompt is one of these stems plus a short tail: stems of whole blocks make prefix hits likely.
STEMS = ((), (0, 1, 2, 0), (0, 1, 2, 0, 1, 1, 2, 2), (0, 1, 2, 1), (2, 2, 2, 2, 0, 1, 2, 0))

Slot = int | None             # the token a block slot holds; None: unknown (a bare sequence's, or stale)


@dataclass
class PromptSeq:
    tokens: list[int]         # every token of the sequence the cache was told of, in order
    computed: int             # leading tokens whose K/V are written
    lookahead: int = 0        # draft slots granted past them last step: the cache's seq_len is the sum
    accepted: tuple[int, ...] = ()   # of last step's drafts, those kept: real tokens from the next ask on


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE)     # replaced by build()
        self.lengths: dict[int, int] = {}                     # bare sequences: tokens appended
        self.running: dict[int, PromptSeq] = {}               # prompt sequences in the cache, oldest first
        self.waiting: dict[int, list[int]] = {}               # prompt sequences out of it: new or preempted
        self.slots: list[list[Slot]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.next_id = FIRST_PROMPT_ID

    @initialize(prefix_caching=st.booleans())
    def build(self, prefix_caching: bool) -> None:
        self.cache = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)

    # ---- bare sequences: the seed's surface -------------------------------------------------

    @rule(seq=st.integers(0, 6))
    def admit(self, seq: int) -> None:
        self.cache.admit(seq)
        self.lengths.setdefault(seq, 0)

    @precondition(lambda self: self.lengths)
    @rule(pick=st.integers(0, 100), count=st.integers(0, 30))
    def append(self, pick: int, count: int) -> None:
        seq = sorted(self.lengths)[pick % len(self.lengths)]
        before = (list(self.cache.block_table(seq).blocks), self.cache.free_blocks())
        try:
            self.cache.append(seq, count)
            self.lengths[seq] += count
        except OutOfBlocks:
            assert (list(self.cache.block_table(seq).blocks), self.cache.free_blocks()) == before
        for block in self.cache.block_table(seq).blocks[len(before[0]):]:
            self.slots[block] = [None] * BLOCK_SIZE          # a bare sequence's tokens are not known
        assert self.cache.seq_len(seq) == self.lengths[seq]

    @rule(seq=st.integers(0, 8))
    def free(self, seq: int) -> None:
        self.cache.free(seq)
        self.lengths.pop(seq, None)

    @rule()
    def evict(self) -> None:
        held = {**self.lengths, **{seq: p.computed + p.lookahead for seq, p in self.running.items()}}
        victim = self.cache.evict_largest()
        if victim is None:
            assert not held
            return
        # The victim holds the most tokens; among equals, the lowest id (as evict_largest documents).
        assert held[victim] == max(held.values())
        assert victim == min(seq for seq, num in held.items() if num == held[victim])
        assert not self.cache.contains(victim)
        if victim in self.lengths:
            del self.lengths[victim]
        else:
            p = self.running.pop(victim)
            self.waiting[victim] = [*p.tokens, *p.accepted]          # to be recomputed, as if preempted

    # ---- prompt sequences: the engine's surface ---------------------------------------------

    @precondition(lambda self: len(self.waiting) < 6)
    @rule(stem=st.sampled_from(STEMS), tail=st.lists(TOKENS, min_size=1, max_size=6))
    def arrive(self, stem: tuple[int, ...], tail: list[int]) -> None:
        self.waiting[self.next_id] = [*stem, *tail]
        self.next_id += 1

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One allocate_step: every running sequence asks (with 0-2 new tokens, as after sampling),
        then up to three waiting ones, in the order drawn; the outcome must match the asks."""
        asks: list[BlockAsk] = []
        for seq, p in self.running.items():
            # Speculation: last step's kept drafts come first among the new tokens (their K/V are
            # computed: num_computed counts them; the rejected ones' slots go back), and any running
            # sequence may ask for draft slots after its tokens.
            new = [*p.accepted, *data.draw(st.lists(TOKENS, max_size=2))]
            num_computed = p.computed + len(p.accepted)
            left = len(p.tokens) + len(new) - num_computed
            asks.append(BlockAsk(seq_id=seq, new_token_ids=tuple(new), max_compute=data.draw(st.integers(0, left)),
                                 is_running=True, num_computed=num_computed,
                                 num_lookahead=data.draw(st.integers(0, 3))))
        candidates: list[int] = []
        if self.waiting:
            candidates = data.draw(st.lists(st.sampled_from(sorted(self.waiting)), unique=True, max_size=3))
        for seq in candidates:
            prompt = self.waiting[seq]
            asks.append(BlockAsk(seq_id=seq, new_token_ids=tuple(prompt),
                                 max_compute=data.draw(st.integers(1, len(prompt))), is_running=False))
        budget = data.draw(st.none() | st.integers(0, 24))
        without_drafts = copy.deepcopy(self.cache).allocate_step(
            [msgspec.structs.replace(a, num_lookahead=0) for a in asks], budget)

        alloc = self.cache.allocate_step(asks, budget)

        by_id = {ask.seq_id: ask for ask in asks}
        granted = {grant.seq_id: grant for grant in alloc.grants}
        preempted = list(alloc.preempted)
        assert len(granted) == len(alloc.grants) and len(set(preempted)) == len(preempted)
        for seq in self.running:                               # every running ask: one or the other
            assert (seq in granted) != (seq in preempted)
        assert set(preempted) <= set(self.running)
        admitted = [seq for seq in candidates if seq in granted]
        assert admitted == candidates[:len(admitted)]          # admission stops at the first refused
        assert not (preempted and admitted)                    # and does not happen after a preemption
        if budget is not None:
            assert sum(granted[seq].num_tokens for seq in admitted) <= budget
        for seq in candidates[len(admitted):]:
            assert not self.cache.contains(seq)
        for seq in preempted:
            assert not self.cache.contains(seq)
            self.waiting[seq] = self.running.pop(seq).tokens + list(by_id[seq].new_token_ids)
        for grant in alloc.grants:
            ask = by_id[grant.seq_id]
            assert grant.block_ids == tuple(self.cache.block_table(grant.seq_id).blocks)
            assert 0 <= grant.num_tokens <= ask.max_compute
            if ask.is_running:
                p = self.running[grant.seq_id]
                p.tokens += ask.new_token_ids
                p.computed, p.accepted = ask.num_computed, ()
                assert grant.num_cached == 0 and grant.start == p.computed
                num_old_blocks = -(-p.computed // BLOCK_SIZE)      # the rest was taken back, or is new
            else:
                prompt = self.waiting.pop(grant.seq_id)
                self.check_hit(prompt, grant.num_cached, grant.block_ids)
                assert grant.start == grant.num_cached
                p = self.running[grant.seq_id] = PromptSeq(prompt, grant.num_cached)
                num_old_blocks = grant.num_cached // BLOCK_SIZE
            assert grant.start + grant.num_tokens <= len(p.tokens)
            end = grant.start + grant.num_tokens
            assert grant.num_lookahead in (0, ask.num_lookahead)
            assert not grant.num_lookahead or end == len(p.tokens)        # drafts follow the last token
            self.compute(p, grant.block_ids, num_old_blocks, end, grant.num_lookahead)
            if grant.num_lookahead:                                     # drafts written, some kept
                drafts = data.draw(st.lists(TOKENS, min_size=grant.num_lookahead, max_size=grant.num_lookahead))
                for i, token in enumerate(drafts):
                    self.slots[grant.block_ids[(end + i) // BLOCK_SIZE]][(end + i) % BLOCK_SIZE] = token
                p.accepted = tuple(drafts[: data.draw(st.integers(0, len(drafts)))])
        # Drafts never cost anyone their blocks: the same asks without them preempt and admit the same.
        assert without_drafts.preempted == alloc.preempted
        assert [g.seq_id for g in without_drafts.grants] == [g.seq_id for g in alloc.grants]
        assert (alloc.num_free_blocks, alloc.num_total_blocks) == (self.cache.free_blocks(), NUM_BLOCKS)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), readmit=st.booleans())
    def finish(self, pick: int, readmit: bool) -> None:
        """Free a prompt sequence; readmitted at once with the same tokens (its computed blocks now
        cached), it gets only blocks holding them."""
        seq = list(self.running)[pick % len(self.running)]
        p = self.running.pop(seq)
        self.cache.free(seq)
        assert not self.cache.contains(seq)
        if not readmit:
            return
        num_cached = self.cache.admit_with_prefix(seq, p.tokens)
        # Only what the hit holds is checked, not how much it finds: blocks other sequences computed
        # count too, and its own may be gone. The cache keeps one block per chain hash, so a block
        # computed alongside a twin that registered the hash first is never registered, and once the
        # twin is evicted that prefix is found no more.
        self.check_hit(p.tokens, num_cached, tuple(self.cache.block_table(seq).blocks))
        self.running[seq] = PromptSeq(p.tokens, num_cached)

    def check_hit(self, prompt: list[int], num_cached: int, block_ids: tuple[int, ...]) -> None:
        """A prefix hit is whole blocks, short of the whole prompt, and each of the table's leading
        `num_cached` blocks holds the prompt's tokens."""
        assert num_cached % BLOCK_SIZE == 0 and num_cached < len(prompt)
        assert self.cache.enable_prefix_caching or num_cached == 0
        assert len(block_ids) >= num_cached // BLOCK_SIZE
        for i, block in enumerate(block_ids[:num_cached // BLOCK_SIZE]):
            assert self.slots[block] == prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], (block, i, prompt)

    def compute(self, p: PromptSeq, block_ids: tuple[int, ...], num_old_blocks: int, end: int,
                lookahead: int = 0) -> None:
        """Write the K/V of tokens p.computed..end into the shadow; blocks past the old table are new,
        their previous contents gone. `lookahead` draft slots follow."""
        assert len(block_ids) == -(-(end + lookahead) // BLOCK_SIZE)
        p.lookahead = lookahead
        for block in block_ids[num_old_blocks:]:
            self.slots[block] = [None] * BLOCK_SIZE
        for pos in range(p.computed, end):
            self.slots[block_ids[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = p.tokens[pos]
        p.computed = end

    # ---- invariants -------------------------------------------------------------------------

    @invariant()
    def reference_counts_are_the_tables_holding_each_block(self) -> None:
        cache = self.cache
        holders: Counter[int] = Counter()
        for seq in cache.sequences():
            table = cache.block_table(seq)
            assert len(table.blocks) == len(set(table.blocks))               # no block twice in a table
            assert len(table.blocks) == -(-table.num_tokens // BLOCK_SIZE)   # whole blocks, none spare
            holders.update(table.blocks)
        if not cache.enable_prefix_caching:
            assert set(holders.values()) <= {1}                              # only a prefix hit shares
        assert [cache.ref_count(b) for b in range(NUM_BLOCKS)] == [holders[b] for b in range(NUM_BLOCKS)]
        assert cache.used_blocks() == len(holders)
        assert cache.free_blocks() + cache.used_blocks() == cache.total_blocks() == NUM_BLOCKS
        # the dashboard's block map says the same, block by block
        expected = ["s" if holders[b] > 1 else "u" if holders[b] else "." for b in range(NUM_BLOCKS)]
        block_map = cache.block_map()
        assert [c if c != "c" else "." for c in block_map] == expected
        assert block_map.count(".") + block_map.count("c") == cache.free_blocks()
        if not cache.enable_prefix_caching:
            assert "c" not in block_map

    @invariant()
    def lengths_match_the_shadow(self) -> None:
        assert set(self.cache.sequences()) == set(self.lengths) | set(self.running)
        for seq, num in self.lengths.items():
            assert self.cache.seq_len(seq) == num
        for seq, p in self.running.items():
            assert self.cache.seq_len(seq) == p.computed + p.lookahead

    @invariant()
    def free_and_cached_blocks_are_the_unreferenced_ones(self) -> None:
        """The free list and the cached (evictable) blocks split the blocks no table holds, and a cached
        block holds the tokens the cache recorded for it.

        Reads the cache's private fields: the free/cached split and the recorded tokens are not part
        of its surface, and a public accessor only for this test is not worth having.
        """
        cache = self.cache
        free, cached, recorded = list(cache._free), list(cache._evictable), cache._hash_of
        assert len(free) == len(set(free)) and not set(free) & set(cached)
        assert set(free) | set(cached) == {b for b in range(NUM_BLOCKS) if cache.ref_count(b) == 0}
        assert len(free) + len(cached) + cache.used_blocks() == NUM_BLOCKS
        assert set(cached) <= set(recorded) and not set(free) & set(recorded)
        assert {h: block for block, (h, _, _) in recorded.items()} == cache._block_of   # one block per hash
        assert cache.enable_prefix_caching or not recorded
        for block, (_, tokens, _) in recorded.items():
            assert tuple(self.slots[block]) == tokens, block
        assert 0 <= cache.num_prefix_hits <= cache.num_prefix_queries


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
