"""The cache allocator actor: sole owner of the block tables, reference counts and prefix cache.

It answers the scheduler's AllocateStep with a StepAllocation, first freeing the sequences the
step names. It holds no K/V data; the model worker's arrays are addressed by the block ids granted
here. Nothing else in the daemon holds the BlockAllocator: the scheduler knows only its layout.
With a KV-event publisher, the cache's events of each step go to it as one batch (never waiting on it).
With a disk tier (forge.engine.disk_tier), a step that admits nothing while blocks load from disk waits
for a load (a few milliseconds, in a thread) instead of sending the scheduler round an empty loop.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.runtime.kv_publisher import KvEventPublisher
from forge.engine.block_allocator import BlockAllocator
from forge.engine.disk_tier import DiskTier
from forge.messages import AllocateStep, CacheStats, StepAllocation

LOAD_WAIT_S = 0.05       # longest wait for a disk load when nothing else can run


class AllocatorActor:
    def __init__(self, cache: BlockAllocator, inbox: MemoryObjectReceiveStream[AllocateStep],
                 replies: MemoryObjectSendStream[StepAllocation], *,
                 publisher: KvEventPublisher | None = None, tier: DiskTier | None = None) -> None:
        self._cache = cache
        self.tier = tier
        cache.tier = tier
        self._publisher = publisher
        self._inbox = inbox
        self._replies = replies

    def statistics(self) -> CacheStats:
        c = self._cache
        return CacheStats(num_free_blocks=c.free_blocks(), num_total_blocks=c.total_blocks(),
                          prefix_hit_rate=c.prefix_hit_rate(), prefix_queries=c.num_prefix_queries,
                          prefix_hits=c.num_prefix_hits, prefix_misses=tuple(c.num_prefix_misses.items()))

    def block_map(self) -> str:
        return self._cache.block_map()

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables: the block tables of live sequences."""
        return {"allocator.seqs": len(self._cache.sequences())}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._replies:
            task_status.started()
            async for step in self._inbox:
                for seq_id in step.frees:
                    self._cache.free(seq_id)
                allocation = self._cache.allocate_step(step.asks, step.admit_budget, flush=step.flush_prefix_cache)
                if self._publisher is not None:
                    self._publisher.publish_nowait(self._cache.take_events())
                if self.tier is not None and self.tier.loading() and not allocation.grants:
                    await anyio.to_thread.run_sync(self.tier.wait_loads, LOAD_WAIT_S)
                await self._replies.send(allocation)

    def close_tier(self) -> None:
        """At unload and drain, no step running: the cached blocks the disk lacks are written, the tier closed."""
        if self.tier is not None:
            self.tier.write_out(self._cache)
            self.tier.close()
            self.tier = self._cache.tier = None
