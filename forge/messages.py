"""Every message that crosses an actor boundary. Pure data: frozen, keyword-only, tagged Structs.

The core uses the same records offline (the engine calls the allocator directly), so the daemon and
the library run one scheduling logic. Replies are routed by request or sequence id, never by
channels inside messages.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from forge.sampling import SamplingParams


class Message(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Immutable, keyword-only, tagged by class name."""


# ---- scheduler <-> cache allocator ----------------------------------------------------------

class BlockAsk(Message):
    """One sequence's wish for this step, in priority order (running first, then waiting)."""
    seq_id: int
    new_token_ids: tuple[int, ...]   # tokens the allocator has not seen yet for this sequence
    max_compute: int                 # most tokens to compute this step (its share of the budget)
    is_running: bool                 # False: admit it now (prefix lookup) if blocks allow


class Grant(Message):
    seq_id: int
    num_cached: int                  # leading tokens found in the prefix cache (new sequences)
    start: int                       # first position computed this step
    num_tokens: int                  # tokens computed this step (may be 0)
    block_ids: tuple[int, ...]       # the sequence's whole block table after this step


class AllocateStep(Message):
    frees: tuple[int, ...]           # sequences that finished or were aborted since the last step
    asks: tuple[BlockAsk, ...]


class StepAllocation(Message):
    grants: tuple[Grant, ...]
    preempted: tuple[int, ...]       # running sequences whose blocks were taken back, in order
    num_free_blocks: int
    num_total_blocks: int


class FreeSeqs(Message):
    seq_ids: tuple[int, ...]


class CacheStats(Message):
    num_free_blocks: int
    num_total_blocks: int
    prefix_hit_rate: float


FinishReason = Literal["stop", "length", "abort", "error"]
