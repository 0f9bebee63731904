"""forge-infer's Scheduler: `Scheduler(SchedulerConfig(max_batch_size=...), cache)` owning its
cache and planning a step in one call, over the daemon's scheduler (forge.engine.scheduler), which knows
the cache only by its layout and leaves allocation to the block allocator.

It also takes the daemon's own SchedulerConfig (policies, token budgets, speculation), so that
one-process tests can drive every scheduling rule through the seed's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from forge.engine import scheduler as core
from forge.engine.block_table import SeqId
from forge.engine.sequence import SeqState, Sequence, TokenId
from forge.seed.paged_cache import PagedKVCache

__all__ = ["Scheduler", "SchedulerConfig", "SeqState", "Sequence", "StepPlan"]


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 8                     # most sequences running at once

    def core(self) -> core.SchedulerConfig:
        return core.SchedulerConfig(max_num_seqs=self.max_batch_size)


@dataclass(slots=True)
class StepPlan:
    admitted: list[SeqId] = field(default_factory=list)
    decode_batch: list[SeqId] = field(default_factory=list)   # sequences that yield a token
    preempted: list[SeqId] = field(default_factory=list)
    finished: list[SeqId] = field(default_factory=list)
    scheduled: list[core.ScheduledSeq] = field(default_factory=list)

    def is_idle(self) -> bool:
        return not (self.admitted or self.decode_batch or self.preempted or self.finished or self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler(core.Scheduler):
    def __init__(self, config: SchedulerConfig | core.SchedulerConfig, cache: PagedKVCache) -> None:
        super().__init__(config.core() if isinstance(config, SchedulerConfig) else config, cache.layout())
        self._cache = cache

    def cache(self) -> PagedKVCache:
        return self._cache

    cache_mut = cache

    def running_seq_mut(self, seq_id: SeqId) -> Sequence | None:
        return self.running_seq(seq_id)

    def schedule(self) -> StepPlan:
        """Plan one step against the owned cache: propose, allocate, commit."""
        step = self.propose()
        for seq_id in step.frees:
            self._cache.free(seq_id)
        alloc = self._cache.allocate_step(step.asks, step.admit_budget)
        was_running = {g.seq_id for g in alloc.grants if self.running_seq(g.seq_id) is not None}
        plan = self.commit(alloc)
        return StepPlan(admitted=[g.seq_id for g in alloc.grants if g.seq_id not in was_running],
                        decode_batch=[s.seq_id for s in plan.scheduled if s.samples],
                        preempted=plan.preempted, finished=plan.finished, scheduled=plan.scheduled)

    def push_token(self, seq_id: SeqId, token: TokenId, is_eos: bool = False) -> None:
        """Record a generated token; on eos, cap the limit so the sequence retires next step."""
        super().push_token(seq_id, token)
        if is_eos:
            seq = self.get(seq_id)
            assert seq is not None
            seq.max_new_tokens = len(seq.output)

    def take_finished(self) -> list[SeqId]:
        """Always empty, as in the seed: finished sequences are reported by StepPlan.finished."""
        return []
