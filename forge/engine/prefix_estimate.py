"""What the scheduler guesses the prefix cache holds, to rank waiting prompts by the work they need.

Shortest-first ranks a waiting prompt by the tokens it will compute, not by its length: the prompt
blocks this scheduler has seen computed (an LRU no larger than the cache) estimate what the
allocator's prefix cache will find. An estimate for ordering only: the allocator's lookup decides
what is reused. Keys are the allocator's own (forge.engine.block_table.block_hash, salted alike).
"""

from __future__ import annotations

from collections import OrderedDict

from forge.engine.block_table import CacheLayout, block_hash, salt_root
from forge.engine.sequence import Sequence


class PrefixEstimate:
    def __init__(self, layout: CacheLayout, *, enabled: bool) -> None:
        self.layout = layout
        self.enabled = enabled
        self._index: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._index)

    def hashes(self, seq: Sequence) -> list[int]:
        """The keys of the prompt's full blocks (computed once per sequence)."""
        if seq.prompt_hashes is None:
            bs, parent, hashes = self.layout.block_size, salt_root(seq.cache_salt), []
            for i in range(len(seq.prompt) // bs):
                parent = block_hash(parent, tuple(seq.prompt[i * bs:(i + 1) * bs]))
                hashes.append(parent)
            seq.prompt_hashes = hashes
        return seq.prompt_hashes

    def cached(self, seq: Sequence) -> int:
        """Leading prompt tokens the prefix cache likely holds (always one token short of the
        prompt, as the allocator leaves the last one to compute); 0 when not estimating, or for a sequence
        that computes every token (Sequence.reads_all_states)."""
        if not self.enabled or seq.reads_all_states:
            return 0
        bs = self.layout.block_size
        hashes = self.hashes(seq)[: (len(seq.prompt) - 1) // bs]
        num = 0
        while num < len(hashes) and hashes[num] in self._index:
            num += 1
        return num * bs

    def next_uncached_block(self, seq: Sequence, num_cached: int) -> int | None:
        """The key of the first prompt block the prefix cache likely lacks (past its `num_cached`
        tokens); None when what is left is less than a block (nothing another prompt could share)."""
        hashes = self.hashes(seq)[: (len(seq.prompt) - 1) // self.layout.block_size]
        num = num_cached // self.layout.block_size
        return hashes[num] if num < len(hashes) else None

    def blocks_in_prefill(self, running: list[Sequence]) -> set[int]:
        """Keys of the prompt blocks running sequences have yet to compute."""
        bs, out = self.layout.block_size, set()
        for seq in running:
            if seq.num_computed_tokens < len(seq.prompt):
                out.update(self.hashes(seq)[seq.num_computed_tokens // bs:])
        return out

    def computed(self, seq: Sequence) -> None:
        """The sequence's K/V are computed up to num_computed_tokens: index its full prompt blocks."""
        if not self.enabled:
            return
        hashes = self.hashes(seq)
        full = min(seq.num_computed_tokens // self.layout.block_size, len(hashes))
        for h in hashes[seq.num_indexed_blocks:full]:
            self._index[h] = None
            self._index.move_to_end(h)
        seq.num_indexed_blocks = max(seq.num_indexed_blocks, full)
        while len(self._index) > self.layout.num_blocks:
            self._index.popitem(last=False)
