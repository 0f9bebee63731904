from __future__ import annotations

import pytest

from forge.messages import BlockAsk
from forge.seed.paged_cache import BlockTable, CacheError, OutOfBlocks, PagedKVCache, UnknownSequence


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PagedKVCache(4, 0)
    with pytest.raises(ValueError):
        PagedKVCache(4, -1)


def test_append_allocates_whole_blocks_and_counts() -> None:
    cache = PagedKVCache(8, 4)
    cache.admit(1)
    cache.append(1, 5)
    assert cache.used_blocks() == 2 and cache.free_blocks() == 6 and cache.total_blocks() == 8
    assert cache.seq_len(1) == 5
    assert cache.utilisation() == pytest.approx(0.25)
    assert cache.block_table(1).num_tokens == 5
    cache.append(1, 3)                      # fills the slack, no new block
    assert cache.used_blocks() == 2


def test_slack_capacity_and_fragmentation_numbers() -> None:
    table = BlockTable(blocks=[3, 4, 5], num_tokens=9)
    assert table.capacity(4) == 12 and table.slack(4) == 3
    cache = PagedKVCache(16, 4)
    for seq, n in [(1, 5), (2, 8), (3, 1)]:
        cache.admit(seq)
        cache.append(seq, n)
    assert cache.internal_fragmentation() == 3 + 0 + 3


def test_blocks_needed_for() -> None:
    cache = PagedKVCache(8, 4)
    assert cache.blocks_needed_for(9, 5) == 2          # unknown: as if empty
    cache.admit(1)
    cache.append(1, 3)
    assert cache.blocks_needed_for(1, 1) == 0
    assert cache.blocks_needed_for(1, 2) == 1
    assert cache.blocks_needed_for(1, 9) == 2
    assert cache.blocks_needed_for(1, 10) == 3


def test_failed_append_changes_nothing() -> None:
    cache = PagedKVCache(3, 4)
    cache.admit(1)
    cache.append(1, 6)
    before = (list(cache.block_table(1).blocks), cache.seq_len(1), cache.free_blocks())
    with pytest.raises(OutOfBlocks) as err:
        cache.append(1, 7)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert isinstance(err.value, CacheError)
    assert (list(cache.block_table(1).blocks), cache.seq_len(1), cache.free_blocks()) == before


def test_unknown_sequence() -> None:
    cache = PagedKVCache(3, 4)
    with pytest.raises(UnknownSequence) as err:
        cache.append(42, 1)
    assert err.value.seq == 42
    assert cache.block_table(42) is None and cache.seq_len(42) == 0 and not cache.contains(42)


def test_free_is_idempotent() -> None:
    cache = PagedKVCache(4, 2)
    cache.admit(1)
    cache.append(1, 5)
    cache.free(1)
    cache.free(1)
    cache.free(99)
    assert cache.free_blocks() == 4 and not cache.contains(1)


def test_evict_largest_frees_the_longest_sequence() -> None:
    cache = PagedKVCache(16, 4)
    for seq, n in [(1, 5), (2, 9), (3, 9), (4, 2)]:
        cache.admit(seq)
        cache.append(seq, n)
    assert cache.evict_largest() == 2          # tie on 9 tokens: the lower id
    assert not cache.contains(2)
    assert cache.evict_largest() == 3
    cache.free(1)
    cache.free(4)
    assert cache.evict_largest() is None
    assert cache.free_blocks() == 16


def test_prefix_cache_shares_full_blocks_and_leaves_one_token() -> None:
    cache = PagedKVCache(16, 4, enable_prefix_caching=True)
    prompt = list(range(100, 110))                       # 10 tokens: 2 full blocks
    assert cache.admit_with_prefix(1, prompt) == 0
    cache.append(1, 10)
    cache.commit_computed(1)
    assert cache.admit_with_prefix(2, prompt) == 8       # both full blocks found
    assert cache.block_table(2).blocks == cache.block_table(1).blocks[:2]
    assert cache.ref_count(cache.block_table(1).blocks[0]) == 2
    exact = list(range(100, 108))                        # 8 tokens: only 1 block may be reused
    assert cache.admit_with_prefix(3, exact) == 4
    other = [1] + prompt[1:]
    assert cache.admit_with_prefix(4, other) == 0        # differs in the first block


def test_freed_blocks_stay_cached_until_needed() -> None:
    cache = PagedKVCache(4, 2, enable_prefix_caching=True)
    cache.admit_with_prefix(1, [1, 2, 3, 4, 5])
    cache.append(1, 5)
    cache.free(1)
    assert cache.free_blocks() == 4                       # evictable blocks count as free
    assert cache.admit_with_prefix(2, [1, 2, 3, 4, 9]) == 4
    cache.free(2)
    cache.admit(3)
    cache.append(3, 8)                                    # needs every block: cache evicted
    cache.free(3)
    assert cache.admit_with_prefix(4, [1, 2, 3, 4, 5]) == 0


def test_allocate_step_preempts_the_lowest_priority_running_sequence() -> None:
    cache = PagedKVCache(4, 2)
    asks = [BlockAsk(seq_id=i, new_token_ids=(1, 2, 3), max_compute=3, is_running=False)
            for i in (1, 2)]
    alloc = cache.allocate_step(asks)
    assert [g.seq_id for g in alloc.grants] == [1, 2] and cache.free_blocks() == 0
    # both decode: each needs no block for token 4, but seq 1 then needs a block for token 5
    grow = [BlockAsk(seq_id=i, new_token_ids=(7,), max_compute=1, is_running=True) for i in (1, 2)]
    assert len(cache.allocate_step(grow).grants) == 2
    grow = [BlockAsk(seq_id=i, new_token_ids=(8,), max_compute=1, is_running=True) for i in (1, 2)]
    alloc = cache.allocate_step(grow)
    assert alloc.preempted == (2,)
    assert [g.seq_id for g in alloc.grants] == [1]
    assert not cache.contains(2) and cache.seq_len(1) == 5


def test_allocate_step_does_not_admit_past_a_waiting_sequence_that_does_not_fit() -> None:
    cache = PagedKVCache(3, 2)
    asks = [BlockAsk(seq_id=1, new_token_ids=tuple(range(8)), max_compute=8, is_running=False),
            BlockAsk(seq_id=2, new_token_ids=(1,), max_compute=1, is_running=False)]
    alloc = cache.allocate_step(asks)
    assert alloc.grants == () and cache.free_blocks() == 3 and not cache.contains(1)


def test_allocate_step_admits_waiting_sequences_within_the_admit_budget() -> None:
    cache = PagedKVCache(16, 2)
    asks = [BlockAsk(seq_id=i, new_token_ids=tuple(range(10 * i, 10 * i + 5)), max_compute=5, is_running=False)
            for i in (1, 2, 3)]
    alloc = cache.allocate_step(asks, admit_budget=7)
    # seq 1 computes 5, seq 2 the 2 left of the budget (a chunk), seq 3 waits for the next step
    assert [(g.seq_id, g.num_tokens) for g in alloc.grants] == [(1, 5), (2, 2)]
    assert not cache.contains(3) and cache.free_blocks() == 16 - 3 - 1


def test_a_flush_forgets_cached_blocks_and_leaves_held_ones_with_their_sequences() -> None:
    cache = PagedKVCache(8, 4, enable_prefix_caching=True)
    held, gone = list(range(100, 109)), list(range(200, 209))    # 2 full blocks each
    for seq, prompt in ((1, held), (2, gone)):
        cache.admit_with_prefix(seq, prompt)
        cache.append(seq, 9)
        cache.commit_computed(seq)
    cache.free(2)                                               # its 2 full blocks stay cached, evictable
    assert cache.free_blocks() == 8 - 3 and cache.block_map().count("c") == 2
    assert cache.flush_prefix_cache() == 4                      # 2 held by seq 1, 2 cached
    assert cache.block_map().count("c") == 0 and cache.free_blocks() == 5
    assert cache.block_table(1).num_tokens == 9                 # the running sequence keeps its blocks
    assert cache.admit_with_prefix(3, held) == 0 and cache.admit_with_prefix(4, gone) == 0
    cache.free(1)                                               # forgotten: back to the free list, not cached
    assert cache.free_blocks() == 8 and cache.block_map().count("c") == 0
    assert cache.allocate_step([], flush=True).num_flushed == 0
