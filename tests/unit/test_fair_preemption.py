"""Preemption for fairness: with every slot (or the blocks) taken, a tenant under its share takes a slot from the
tenant furthest over its share, at once and one a step; a sequence just admitted is not taken, two tenants of
equal load never take slots back and forth, priorities stay above fairness, and with one tenant (no tenant
file) nothing is ever preempted for fairness."""

from __future__ import annotations

from typing import Any

from forge.engine.fair_share import MIN_RUN_STEPS, FairShare
from forge.engine.sequence import SeqState, Sequence
from forge.seed.toy_scheduler import Scheduler
from tests.unit.test_fair_share import make as fair_share_make
from tests.unit.test_fair_share import seq as fair_share_seq
from tests.unit.test_fair_share import step


def make(num_blocks: int = 512, block_size: int = 4, **config: int | str) -> Scheduler:
    """test_fair_share's scheduler with room for long requests."""
    return fair_share_make(num_blocks, block_size, **config)


def seq(seq_id: int, *, max_new: int = 200, **fields: Any) -> Sequence:
    """test_fair_share's sequence, long enough to be running when the light tenant arrives."""
    return fair_share_seq(seq_id, max_new=max_new, **fields)


def run(sched: Scheduler, num_steps: int) -> list[int]:
    return [seq_id for _ in range(num_steps) for seq_id in step(sched)]


def running(sched: Scheduler, tenant: str | None) -> int:
    return sum(1 for s in sched._running if s.tenant == tenant)


def heavy_batch(max_num_seqs: int = 4, num_queued: int = 4, **config: int | str) -> Scheduler:
    """`max_num_seqs` heavy sequences running for MIN_RUN_STEPS steps, `num_queued` more waiting."""
    sched = make(max_num_seqs=max_num_seqs, **config)
    for i in range(max_num_seqs + num_queued):
        sched.submit(seq(i, tenant="heavy"))
    assert step(sched) == list(range(max_num_seqs))
    run(sched, MIN_RUN_STEPS)
    return sched


def test_a_light_request_takes_a_slot_from_the_heavy_tenant_at_the_next_step() -> None:
    for policy in ("fcfs", "shortest-first"):
        sched = heavy_batch(policy=policy)
        sched.submit(seq(100, tenant="light", max_new=4))
        assert step(sched) == [100], policy                 # before the heavy tenant's queue, no slot free
        preempted = [s for s in (sched.get(i) for i in range(4)) if s is not None and s.state is SeqState.PREEMPTED]
        assert len(preempted) == 1 and sched.num_fair_preemptions == sched.num_preemptions == 1, policy
        assert preempted[0].id == 3                          # the most recently admitted (ties: the last)
        # The light one ends; its slot goes back to the heavy tenant (first the preempted one, recomputed).
        assert run(sched, 8) == [3] and sched.num_fair_preemptions == 1, policy


def test_a_sequence_just_admitted_is_not_taken() -> None:
    sched = make(max_num_seqs=2)
    for i in range(4):
        sched.submit(seq(i, tenant="heavy"))
    step(sched)
    run(sched, MIN_RUN_STEPS - 2)
    sched.submit(seq(100, tenant="light"))
    assert step(sched) == [] and sched.num_fair_preemptions == 0     # neither heavy one has run long enough
    assert step(sched) == [100] and sched.num_fair_preemptions == 1


def test_two_tenants_of_equal_load_settle_at_equal_slots_and_stay_there() -> None:
    sched = heavy_batch(max_num_seqs=4, num_queued=4)       # "heavy" holds all four
    for i in range(8):
        sched.submit(seq(100 + i, tenant="other"))
    run(sched, 3 * MIN_RUN_STEPS)
    assert running(sched, "heavy") == running(sched, "other") == 2
    assert sched.num_fair_preemptions == 2                   # one a step, until the split is even
    run(sched, 6 * MIN_RUN_STEPS)                            # still both loaded: no slot moves again
    assert sched.num_fair_preemptions == 2 and sched.num_preemptions == 2


def test_shares_weigh_the_slots() -> None:
    sched = make(max_num_seqs=8)
    for i in range(12):
        sched.submit(seq(i, tenant="small"))
    step(sched)
    run(sched, MIN_RUN_STEPS)
    for i in range(12):
        sched.submit(seq(100 + i, tenant="big", share=3.0))
    run(sched, 4 * MIN_RUN_STEPS)
    assert (running(sched, "big"), running(sched, "small")) == (6, 2)


def test_without_tenants_nothing_is_preempted_for_fairness() -> None:
    sched = make(max_num_seqs=2)
    for i in range(6):
        sched.submit(seq(i, max_new=MIN_RUN_STEPS * 2))
    admitted = run(sched, MIN_RUN_STEPS * 8)
    assert admitted == [0, 1, 2, 3, 4, 5] and sched.num_preemptions == 0


def test_priority_stays_above_fairness() -> None:
    # A light request less urgent than every running one takes nothing.
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.submit(seq(i, tenant="heavy", priority=-1))
    step(sched)
    run(sched, MIN_RUN_STEPS)
    sched.submit(seq(100, tenant="light", priority=0))
    assert step(sched) == [] and sched.num_preemptions == 0
    # A more urgent heavy request goes before the light one, by priority, not by share.
    sched = heavy_batch(max_num_seqs=2, num_queued=0)
    sched.submit(seq(100, tenant="light", priority=1))
    sched.submit(seq(5, tenant="heavy", priority=-1))
    assert step(sched) == [5] and sched.num_fair_preemptions == 0 and sched.num_preemptions == 1


def test_blocks_too_few_for_the_light_request_free_a_heavy_one() -> None:
    """Slots to spare, but the heavy sequences hold nearly every block."""
    sched = make(num_blocks=36, max_num_seqs=8)
    for i in range(2):
        sched.submit(seq(i, tenant="heavy", prompt_len=40, max_new=100))
    step(sched)
    assert MIN_RUN_STEPS <= 16
    run(sched, 16)                                          # 15 blocks each: 6 left
    sched.submit(seq(100, tenant="light", prompt_len=34, max_new=4))
    assert step(sched) == [] and sched.num_preemptions == 0  # refused: 9 blocks needed
    assert step(sched) == [100] and sched.num_fair_preemptions == sched.num_preemptions == 1
    assert run(sched, 8) == [1]                     # the light one ends; the preempted heavy one is back
    assert sched.get(100) is None and running(sched, "heavy") == 2
    assert sched.num_fair_preemptions == sched.num_preemptions == 1


def test_the_victim_is_of_the_tenant_furthest_over_its_share_and_of_the_heads_priority() -> None:
    fair = FairShare()
    step_now = 10 * MIN_RUN_STEPS
    a = [seq(i, tenant="a") for i in range(3)]
    b = [seq(10 + i, tenant="b", share=2.0) for i in range(4)]     # 4 for a share of 2: 2 a share, a has 3
    c = [seq(20, tenant="c", priority=-1)]
    for i, s in enumerate(a + b + c):
        s.admitted_step, s.num_computed_tokens = i, s.total_len() - 1     # decoding
    for s in a + b + c:
        fair.charge(s, 100)
    head = seq(30, tenant="d")
    assert fair.victim(a + b + c, head, step_now) is a[2]          # a: most running for its share; its newest
    a[2].admitted_step = step_now - 1                              # a's newest has only just started
    assert fair.victim(a + b + c, head, step_now) is a[1]
    a[1].num_computed_tokens = 0                                   # a's next is still computing its prompt
    assert fair.victim(a + b + c, head, step_now) is a[0]
    assert fair.victim(a + b + c, seq(31, tenant="d", priority=-1), step_now) is None   # c has only one
    fair.charge(head, 10_000)                                      # d has had more service than everyone
    assert fair.victim(a + b + c, head, step_now) is None
    assert fair.victim(a + b + c, seq(32, tenant="a"), step_now) is None   # a is the one furthest over
