"""forge-infer's PagedKVCache: the block allocator (forge.engine.block_allocator) with the seed's own
surface on top. The daemon never calls these; they are the seed's API, kept to its names."""

from __future__ import annotations

from forge.engine.block_allocator import BlockAllocator
from forge.engine.block_table import BlockTable, CacheError, OutOfBlocks, SeqId, UnknownSequence

__all__ = ["BlockTable", "CacheError", "OutOfBlocks", "PagedKVCache", "UnknownSequence"]


class PagedKVCache(BlockAllocator):
    """The seed's cache: `PagedKVCache(num_blocks, block_size)`, plus its queries and eviction."""

    def utilisation(self) -> float:
        total = self.total_blocks()
        return self.used_blocks() / total if total else 0.0

    def admit(self, seq: SeqId) -> None:
        """Register a sequence with no tokens. Admitting a known sequence changes nothing."""
        if self.block_table(seq) is None:
            self.admit_with_prefix(seq, ())

    def contains(self, seq: SeqId) -> bool:
        return self.block_table(seq) is not None

    def seq_len(self, seq: SeqId) -> int:
        table = self.block_table(seq)
        return table.num_tokens if table is not None else 0

    def internal_fragmentation(self) -> int:
        """Token slots allocated but unused, over all sequences."""
        bs = self.block_size()
        return sum(t.slack(bs) for t in map(self.block_table, self.sequences()) if t is not None)

    def evict_largest(self) -> SeqId | None:
        """Free the sequence holding the most tokens (ties: the lowest id) and return its id."""
        seqs = self.sequences()
        if not seqs:
            return None
        victim = min(seqs, key=lambda s: (-self.seq_len(s), s))
        self.free(victim)
        return victim
