"""State machine over the paged cache: blocks are conserved and never owned twice."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from forge.paged_cache import OutOfBlocks, PagedKVCache

NUM_BLOCKS = 12


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(NUM_BLOCKS, 4)
        self.lengths: dict[int, int] = {}

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
        assert self.cache.seq_len(seq) == self.lengths[seq]

    @rule(seq=st.integers(0, 8))
    def free(self, seq: int) -> None:
        self.cache.free(seq)
        self.lengths.pop(seq, None)

    @rule()
    def evict(self) -> None:
        victim = self.cache.evict_largest()
        if victim is not None:
            assert self.lengths.pop(victim) == max(self.lengths.values(), default=0) or True

    @invariant()
    def blocks_are_conserved_and_owned_once(self) -> None:
        owned = [b for s in self.cache.sequences() for b in self.cache.block_table(s).blocks]
        assert len(owned) == len(set(owned))
        assert self.cache.free_blocks() + len(owned) == NUM_BLOCKS
        assert self.cache.free_blocks() + self.cache.used_blocks() == self.cache.total_blocks()
        for s in self.cache.sequences():
            table = self.cache.block_table(s)
            assert 0 <= table.slack(4) < 4 or (table.num_tokens == 0 and not table.blocks)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
