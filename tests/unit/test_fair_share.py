"""Priorities and fair turns in the scheduler: the more urgent priority is admitted first, a tenant with
one waiting sequence is admitted before a tenant with many that has had recent service, shares weigh the
turns, preemption picks the least urgent, and a full batch gives a slot up to a more urgent arrival."""

from __future__ import annotations

from forge.engine.fair_share import FairShare, is_mixed
from forge.engine.scheduler import SchedulerConfig
from forge.engine.sequence import SeqState, Sequence
from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_scheduler import Scheduler


def make(num_blocks: int = 64, block_size: int = 4, **config: int | str) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), PagedKVCache(num_blocks, block_size))


def seq(seq_id: int, *, tenant: str | None = None, priority: int = 0, share: float = 1.0,
        prompt_len: int = 3, max_new: int = 4) -> Sequence:
    s = Sequence(seq_id, list(range(1, prompt_len + 1)), max_new)
    s.tenant, s.priority, s.share = tenant, priority, share
    return s


def step(sched: Scheduler) -> list[int]:
    """One step; the ids admitted in it."""
    plan = sched.schedule()
    for seq_id in plan.decode_batch:
        sched.push_token(seq_id, 7)
    return plan.admitted


def test_the_more_urgent_priority_is_admitted_first_whatever_its_arrival() -> None:
    for policy in ("fcfs", "shortest-first"):
        sched = make(max_num_seqs=2, policy=policy)
        for i in range(4):
            sched.submit(seq(i, priority=5))
        sched.submit(seq(10, priority=-1, prompt_len=8))
        sched.submit(seq(11, priority=2))
        assert step(sched) == [10, 11], policy


def test_a_light_tenant_goes_before_the_queue_of_a_heavy_one_that_has_had_service() -> None:
    sched = make(max_num_seqs=2, num_blocks=256)
    for i in range(8):
        sched.submit(seq(i, tenant="heavy", max_new=3))
    assert step(sched) == [0, 1]                        # alone: the policy's order
    step(sched)
    sched.submit(seq(100, tenant="light", max_new=3))
    admitted: list[int] = []
    while sched.has_work():
        admitted += step(sched)
    assert admitted[0] == 100, admitted                 # the light one's turn comes first once a slot frees
    assert admitted[1:] == [2, 3, 4, 5, 6, 7]           # the heavy queue in its own order after it


def test_without_tenants_or_priorities_the_policy_order_stands() -> None:
    sched = make(max_num_seqs=2)
    for i in range(5):
        sched.submit(seq(i))
    admitted: list[int] = []
    while sched.has_work():
        admitted += step(sched)
    assert admitted == [0, 1, 2, 3, 4] and sched.fair.service.keys() <= {None}


def test_turns_follow_the_shares_and_service_decays() -> None:
    fair = FairShare()
    big = [seq(i, tenant="big", share=3.0, prompt_len=10) for i in range(6)]
    small = [seq(10 + i, tenant="small", prompt_len=10) for i in range(6)]
    order = fair.order(big + small, 8)
    assert [s.tenant for s in order].count("big") == 6 and order[0].tenant == "big"
    # big costs 10/3 a turn, small 10: big has three turns for each of small's
    assert [s.tenant for s in order[:4]] == ["big", "small", "big", "big"]
    fair.charge(big[0], 300)
    assert fair.order(big + small, 1)[0].tenant == "small"
    for _ in range(64 * 20):
        fair.tick()
    assert "big" not in fair.service                    # forgotten once small
    assert is_mixed(big + small) and not is_mixed(big) and not is_mixed([])


def test_preemption_takes_the_least_urgent_running_sequence_first() -> None:
    sched = make(num_blocks=4, block_size=2)
    sched.submit(seq(1, priority=9, prompt_len=3, max_new=5))
    sched.submit(seq(2, priority=0, prompt_len=3, max_new=5))
    step(sched)
    step(sched)                                         # 4 tokens each: both blocks full
    plan = sched.schedule()                             # both need a block: the priority-9 one gives
    assert plan.preempted == [1] and sched.get(1).state is SeqState.PREEMPTED


def test_a_full_batch_gives_a_slot_up_to_a_more_urgent_arrival() -> None:
    sched = make(max_num_seqs=2)
    sched.submit(seq(1, priority=3, max_new=20))
    sched.submit(seq(2, priority=5, max_new=20))
    step(sched)
    step(sched)
    sched.submit(seq(3, priority=4, max_new=20))        # more urgent than 2 only
    assert step(sched) == [3]
    assert sched.get(2).state is SeqState.PREEMPTED and sched.num_preemptions == 1
    assert not sched.cache().contains(2)
    assert sched.get(1).state is SeqState.RUNNING
    sched.submit(seq(4, priority=5, max_new=20))        # not more urgent than any running one: waits
    assert step(sched) == [] and sched.get(4).state is SeqState.WAITING
