"""The cache allocator actor: sole owner of the block tables, reference counts and prefix cache.

It answers the scheduler's AllocateStep with a StepAllocation and frees what FreeSeqs names.
It holds no K/V data; the model worker's arrays are addressed by the block ids granted here.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from forge.messages import AllocateStep, CacheStats, FreeSeqs, StepAllocation
from forge.paged_cache import PagedKVCache


class AllocatorActor:
    def __init__(self, cache: PagedKVCache, inbox: MemoryObjectReceiveStream[AllocateStep | FreeSeqs],
                 replies: MemoryObjectSendStream[StepAllocation]) -> None:
        self._cache = cache
        self._inbox = inbox
        self._replies = replies

    def statistics(self) -> CacheStats:
        c = self._cache
        return CacheStats(num_free_blocks=c.free_blocks(), num_total_blocks=c.total_blocks(),
                          prefix_hit_rate=c.prefix_hit_rate())

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._replies:
            task_status.started()
            async for msg in self._inbox:
                match msg:
                    case AllocateStep(frees=frees, asks=asks, admit_budget=admit_budget):
                        for seq_id in frees:
                            self._cache.free(seq_id)
                        await self._replies.send(self._cache.allocate_step(asks, admit_budget))
                    case FreeSeqs(seq_ids=seq_ids):
                        for seq_id in seq_ids:
                            self._cache.free(seq_id)
