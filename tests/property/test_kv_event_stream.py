"""The KV events a router reads replay to the allocator's cached blocks: a state machine drives the block
allocator through steps the way the scheduler does (admit prompts, compute them, append tokens, finish,
flush the prefix cache, evict under pressure), encodes and decodes every batch as the wire carries it, and
applies the events to an empty set. After every step that set is the allocator's set of cached chain keys.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from forge.engine.block_allocator import BlockAllocator
from forge.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from forge.messages import BlockAsk

NUM_BLOCKS = 10
BLOCK_SIZE = 4
STEMS = ((0, 1, 2, 0), (0, 1, 2, 0, 1, 1, 2, 2), (2, 2, 2, 2, 0, 1, 2, 0), ())
TOKENS = st.lists(st.integers(0, 2), max_size=6)


class EventStreamMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, record_events=True)
        self.replayed: set[int] = set()
        self.running: dict[int, int] = {}      # seq -> tokens known to the cache but not yet granted
        self.next_id = 0

    def step(self, asks: list[BlockAsk], frees: tuple[int, ...] = (), *, flush: bool = False) -> None:
        for seq in frees:
            self.cache.free(seq)
        allocation = self.cache.allocate_step(asks, flush=flush)
        for seq in allocation.preempted:
            self.running.pop(seq, None)
        granted = {g.seq_id for g in allocation.grants}
        for ask in asks:
            if not ask.is_running and ask.seq_id in granted:
                self.running[ask.seq_id] = 0
        self.replay(self.cache.take_events())

    def replay(self, events: list) -> None:
        if not events:
            return
        batch = decode_batch(encode_batch(KVEventBatch(ts=0.0, events=tuple(events))))
        for event in batch.events:
            match event:
                case BlockStored(block_hashes=hashes, token_ids=tokens, block_size=size):
                    assert size == BLOCK_SIZE and len(tokens) == size * len(hashes)
                    assert not self.replayed & set(hashes), "a block is stored once until removed"
                    self.replayed |= set(hashes)
                case BlockRemoved(block_hashes=hashes):
                    assert set(hashes) <= self.replayed, "only a stored block is removed"
                    self.replayed -= set(hashes)
                case AllBlocksCleared():
                    self.replayed.clear()

    @rule(stem=st.sampled_from(STEMS), tail=TOKENS)
    def admit(self, stem: tuple[int, ...], tail: list[int]) -> None:
        prompt = (*stem, *tail) or (1,)
        self.next_id += 1
        self.step([BlockAsk(seq_id=self.next_id, new_token_ids=prompt, max_compute=64, is_running=False)])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def decode(self, pick: int, tokens: list[int]) -> None:
        seq = sorted(self.running)[pick % len(self.running)]
        self.step([BlockAsk(seq_id=seq, new_token_ids=tuple(tokens), max_compute=len(tokens), is_running=True)])

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(min_value=0))
    def finish(self, pick: int) -> None:
        seq = sorted(self.running)[pick % len(self.running)]
        del self.running[seq]
        self.step([], frees=(seq,))

    @rule()
    def flush(self) -> None:
        self.step([], flush=True)

    @invariant()
    def events_replay_to_the_cached_blocks(self) -> None:
        assert self.replayed == self.cache.cached_keys()


TestEventStream = EventStreamMachine.TestCase
TestEventStream.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_no_events_unless_recorded() -> None:
    cache = BlockAllocator(4, 4, enable_prefix_caching=True)
    cache.allocate_step([BlockAsk(seq_id=1, new_token_ids=tuple(range(9)), max_compute=9, is_running=False)])
    cache.free(1)
    assert cache.take_events() == [] and len(cache.cached_keys()) == 2


def test_the_wire_format_is_vllms() -> None:
    """A batch is a positional array; an event a map tagged by its class name under "type", with every
    field of vLLM's BlockStored that has no default (what vllm-router requires)."""
    import msgspec

    stored = BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4)
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=1.5, events=(stored, AllBlocksCleared()))))
    assert raw[0] == 1.5 and raw[2] == 0
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
                         "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None, "medium": "GPU",
                         "lora_name": None}
    assert raw[1][1] == {"type": "AllBlocksCleared"}
