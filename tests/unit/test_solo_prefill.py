"""A prompt of a tenant under its share gets a step of its own: the running sequences (the heavy tenant's
decodes, and their drafts) compute nothing in it, so its first token waits for its own prefill alone; never two
such steps in a row, so the running sequences advance at least every other step; never with one tenant, nor
for a tenant that is not under its share, a prompt that does not fit the step, or one whose blocks are not free."""

from __future__ import annotations

from forge.engine.fair_share import MIN_RUN_STEPS
from forge.seed.toy_scheduler import Scheduler
from tests.unit.test_fair_preemption import heavy_batch, make, run, seq


def plan(sched: Scheduler) -> dict[int, int]:
    """One step: the tokens each sequence computes in it."""
    out = sched.schedule()
    for s in out.scheduled:
        if s.samples:
            sched.push_token(s.seq_id, 7)
    return {s.seq_id: s.num_tokens for s in out.scheduled}


def test_a_light_prompt_is_computed_alone_and_the_heavy_rows_go_on_at_the_next_step() -> None:
    for policy in ("fcfs", "shortest-first"):
        sched = make(max_num_seqs=8, policy=policy)
        for i in range(4):                                            # slots to spare
            sched.submit(seq(i, tenant="heavy"))
        run(sched, MIN_RUN_STEPS)
        sched.submit(seq(100, tenant="light", prompt_len=5, max_new=4))
        assert plan(sched) == {100: 5}, policy                        # its prompt alone; it samples
        assert sched.num_solo_prefills == 1
        assert plan(sched) == {0: 1, 1: 1, 2: 1, 3: 1, 100: 1}, policy    # then everyone, as before


def test_with_every_slot_taken_the_light_prompt_takes_one_and_runs_alone() -> None:
    sched = heavy_batch(max_num_seqs=4, num_queued=4)
    sched.submit(seq(100, tenant="light", max_new=4))
    assert plan(sched) == {100: 3} and sched.num_fair_preemptions == 1


def test_never_two_such_steps_in_a_row() -> None:
    sched = make(max_num_seqs=8)
    for i in range(2):
        sched.submit(seq(i, tenant="heavy"))
    run(sched, MIN_RUN_STEPS)
    sched.submit(seq(100, tenant="light", max_new=50))
    sched.submit(seq(101, tenant="other", max_new=50))
    assert plan(sched) == {100: 3, 101: 3}                           # both under their share: one step for both
    sched.submit(seq(102, tenant="third", max_new=50))
    assert plan(sched) == {0: 1, 1: 1, 100: 1, 101: 1, 102: 3}        # the next one joins an ordinary step
    sched.submit(seq(103, tenant="fourth", max_new=50))
    assert plan(sched) == {103: 3} and sched.num_solo_prefills == 2


def test_one_tenant_or_a_tenant_at_its_share_gets_ordinary_steps() -> None:
    sched = make(max_num_seqs=8)
    for i in range(2):
        sched.submit(seq(i, tenant="heavy"))
    run(sched, MIN_RUN_STEPS)
    sched.submit(seq(2, tenant="heavy", max_new=50))                 # one tenant: nothing changes
    assert plan(sched) == {0: 1, 1: 1, 2: 3}
    sched.submit(seq(100, tenant="light", share=0.25, max_new=50))   # 0 running, but a share of a quarter...
    assert plan(sched) == {100: 3}                                   # ... is still under 3 for a share of 1
    run(sched, 2)
    sched.submit(seq(101, tenant="light", share=0.25, max_new=50))   # 1 for 0.25 is 4 a share: over heavy's 3
    assert plan(sched) == {0: 1, 1: 1, 2: 1, 100: 1, 101: 3} and sched.num_solo_prefills == 1


def test_a_prompt_longer_than_the_step_or_the_free_blocks_is_not_computed_alone() -> None:
    sched = make(max_num_seqs=8, max_num_batched_tokens=16)
    for i in range(2):
        sched.submit(seq(i, tenant="heavy"))
    run(sched, MIN_RUN_STEPS)
    sched.submit(seq(100, tenant="light", prompt_len=40, max_new=4))
    assert plan(sched) == {0: 1, 1: 1, 100: 14}                       # chunked beside the decodes, as before
    assert sched.num_solo_prefills == 0
    sched = make(num_blocks=12, max_num_seqs=8)
    for i in range(2):
        sched.submit(seq(i, tenant="heavy", prompt_len=12, max_new=30))
    run(sched, MIN_RUN_STEPS)                                         # 5 blocks each: 2 free
    sched.submit(seq(100, tenant="light", prompt_len=10, max_new=2))  # 3 blocks
    assert 100 not in plan(sched) and sched.num_solo_prefills == 0
