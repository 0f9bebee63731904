"""State machine over the scheduler: limits hold, states are exclusive, everything finishes."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from forge.engine.scheduler import SchedulerConfig
from forge.engine.sequence import SeqState, Sequence
from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_scheduler import Scheduler

BLOCK_SIZE = 4
NUM_BLOCKS = 10          # 40 tokens: far too small for all sequences, enough for each alone
MAX_BATCH = 3


class SchedulerMachine(RuleBasedStateMachine):
    policy = "fcfs"

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=MAX_BATCH, max_num_batched_tokens=12,
                                               policy=self.policy), self.cache)
        self.submitted: set[int] = set()
        self.finished: set[int] = set()
        self.next_id = 0

    @rule(prompt_len=st.integers(1, 24), max_new=st.integers(1, 16), shared=st.booleans(),
          priority=st.integers(0, 2), tenant=st.sampled_from([None, "a", "b"]))
    def submit(self, prompt_len: int, max_new: int, shared: bool, priority: int, tenant: str | None) -> None:
        prompt = list(range(prompt_len)) if shared else [self.next_id + 50] * prompt_len
        seq = Sequence(self.next_id, prompt, max_new)
        seq.priority, seq.tenant = priority, tenant       # priorities and tenants (forge.engine.fair_share)
        self.sched.submit(seq)
        self.submitted.add(self.next_id)
        self.next_id += 1

    @rule(eos_pick=st.integers(0, 10))
    def step(self, eos_pick: int) -> None:
        self._step(eos_pick)

    @rule(pick=st.integers(0, 1000))
    def abort(self, pick: int) -> None:
        live = sorted(self.submitted - self.finished)
        if live:
            seq_id = live[pick % len(live)]
            assert self.sched.abort(seq_id)
            self.finished.add(seq_id)                          # the caller knows its own aborts

    def _step(self, eos_pick: int = 5) -> None:
        running_before = {s.id for s in self.sched._running}
        plan = self.sched.schedule()
        assert plan.num_tokens <= 12
        for seq_id in plan.preempted:
            assert seq_id in running_before
            assert not self.cache.contains(seq_id)          # preemption frees every block
        for seq_id in plan.decode_batch:
            self.sched.push_token(seq_id, 3, is_eos=(seq_id % 11 == eos_pick))
        self.finished.update(plan.finished)

    @invariant()
    def limits_and_exclusive_states(self) -> None:
        sched = self.sched
        assert sched.running_len() <= MAX_BATCH
        running = {s.id for s in sched._running}
        waiting = {s.id for s in sched._waiting}
        assert not running & waiting and not (running | waiting) & self.finished
        for s in sched._running:
            assert s.state is SeqState.RUNNING and self.cache.contains(s.id)
        for s in sched._waiting:
            assert s.state in (SeqState.WAITING, SeqState.PREEMPTED)
            assert not self.cache.contains(s.id)
        assert self.cache.free_blocks() + self.cache.used_blocks() == NUM_BLOCKS

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.sched.has_work():
                break
            self._step()
        assert not self.sched.has_work()
        assert self.finished == self.submitted                 # every sequence finished
        assert self.cache.free_blocks() == NUM_BLOCKS          # and gave back every block


class ShortestFirstMachine(SchedulerMachine):
    policy = "shortest-first"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestShortestFirstMachine = ShortestFirstMachine.TestCase
TestShortestFirstMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
