"""The paged cache's small parts (forge.engine.block_allocator uses them): a sequence's block table, the prefix
cache's keys, its errors, and what the allocator asks of a tier below it (forge.engine.disk_tier)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from forge.errors import ForgeError

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


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The figures a planner needs about a cache it does not own: they never change after start-up."""
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = False


def divceil(a: int, b: int) -> int:
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


class LowerTier(Protocol):
    """A store under the prefix cache (forge.engine.disk_tier.DiskTier): it keeps the blocks the cache forgets
    and brings them back for prompts that miss. `alloc` is the BlockAllocator calling."""

    def evicted(self, block: BlockId, key: bytes, token_ids: tuple[int, ...]) -> None:
        """The cache forgets `block` (its K/V intact until the step after this call)."""

    def collect(self, alloc: Any) -> None:
        """At the start of each allocation: blocks brought back since the last one join the cache."""

    def fetch(self, alloc: Any, seq: SeqId, token_ids: tuple[int, ...], cache_salt: str | None) -> bool:
        """A waiting prompt is about to be admitted: True to hold it back while its blocks come in."""

    def admitted(self, alloc: Any, seq: SeqId, num_cached: int, num_tokens: int) -> None:
        """The prompt was admitted with `num_cached` tokens found."""
