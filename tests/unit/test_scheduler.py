from __future__ import annotations

import pytest

from forge.engine.schedule_policy import AGING_STEPS
from forge.engine.scheduler import SchedulerConfig
from forge.engine.sequence import SeqState, Sequence
from forge.errors import CapacityError
from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_scheduler import Scheduler
from forge.spec_decode.speculation import Lookahead, SpeculativeConfig


def make(num_blocks: int = 16, block_size: int = 4, **config: int | str) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), PagedKVCache(num_blocks, block_size))


def run_step(sched: Scheduler, token: int = 7) -> list[int]:
    plan = sched.schedule()
    for seq_id in plan.decode_batch:
        sched.push_token(seq_id, token, False)
    return plan.decode_batch


def test_admits_up_to_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for i in range(3):
        sched.submit(Sequence(i, [1, 2, 3], 4))
    plan = sched.schedule()
    assert plan.admitted == [0, 1] and plan.decode_batch == [0, 1]
    assert sched.running_len() == 2 and sched.waiting_len() == 1
    assert sched.running_seq(2) is None and sched.get(2).state is SeqState.WAITING


def test_sequence_runs_to_its_limit_and_retires() -> None:
    sched = make()
    sched.submit(Sequence(1, [1, 2], 3))
    for _ in range(3):
        assert run_step(sched) == [1]
    plan = sched.schedule()
    assert plan.finished == [1] and not sched.has_work()
    assert sched.take_finished() == []                # as in the seed: StepPlan.finished reports it
    assert sched.cache().free_blocks() == 16


def test_eos_caps_the_limit() -> None:
    sched = make()
    sched.submit(Sequence(1, [1, 2], 50))
    sched.schedule()
    sched.push_token(1, 0, True)
    seq = sched.running_seq(1)
    assert seq.max_new_tokens == 1 and seq.is_complete()
    assert sched.schedule().finished == [1]


def test_chunked_prefill_respects_the_token_budget_and_decodes_go_first() -> None:
    sched = make(num_blocks=32, max_num_batched_tokens=4)
    sched.submit(Sequence(1, [5, 6], 10))
    run_step(sched)                                   # seq 1 prefilled, now decoding
    sched.submit(Sequence(2, list(range(10)), 2))
    chunks = []
    for _ in range(4):
        plan = sched.schedule()
        assert plan.num_tokens <= 4
        chunks.append({s.seq_id: s.num_tokens for s in plan.scheduled})
        for seq_id in plan.decode_batch:
            sched.push_token(seq_id, 9, False)
    assert chunks == [{1: 1, 2: 3}, {1: 1, 2: 3}, {1: 1, 2: 3}, {1: 1, 2: 1}]
    assert sched.get(2).output == [9]                 # it sampled only once its prompt was done


def test_preemption_frees_blocks_and_requeues_at_the_front() -> None:
    sched = make(num_blocks=4, block_size=2)
    sched.submit(Sequence(1, [1, 2, 3], 5))
    sched.submit(Sequence(2, [1, 2, 3], 5))
    sched.submit(Sequence(3, [4], 1))
    run_step(sched)
    run_step(sched)                                   # 4 tokens each: both blocks full
    assert sched.running_len() == 2
    plan = sched.schedule()                           # both need a block for token 5: one gives
    assert plan.preempted == [2]
    seq2 = sched.get(2)
    assert seq2.state is SeqState.PREEMPTED and seq2.num_computed_tokens == 0
    assert not sched.cache().contains(2)
    assert sched.waiting_len() == 2 and sched.num_preemptions == 1
    assert next(iter(sched._waiting)).id == 2         # ahead of seq 3


def test_abort_removes_the_sequence_and_frees_its_blocks() -> None:
    sched = make()
    sched.submit(Sequence(1, [1, 2, 3, 4, 5], 10))
    sched.submit(Sequence(2, [1], 10))
    run_step(sched)
    assert sched.abort(1) and sched.abort(2) is True and sched.abort(3) is False
    plan = sched.schedule()
    assert sched.cache().free_blocks() == 16 and not sched.has_work()
    assert sorted(plan.finished) == [1, 2]


def test_a_sequence_larger_than_the_whole_cache_is_refused() -> None:
    sched = make(num_blocks=2, block_size=4)
    with pytest.raises(CapacityError):
        sched.submit(Sequence(1, [1] * 6, 5))
    sched.submit(Sequence(2, [1] * 4, 4))
    with pytest.raises(ValueError):
        sched.submit(Sequence(2, [1], 1))


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    cache = PagedKVCache(32, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(), cache)
    prompt = list(range(1, 14))
    sched.submit(Sequence(1, prompt, 2))
    while sched.has_work():
        run_step(sched)
    sched.submit(Sequence(2, prompt + [99], 1))
    plan = sched.schedule()
    assert plan.scheduled[0].start == 12 and plan.scheduled[0].num_tokens == 2
    assert sched.get(2).num_cached_tokens == 12


def shares(plan) -> dict[int, int]:  # noqa: ANN001
    return {s.seq_id: s.num_tokens for s in plan.scheduled}


def test_a_cached_prompt_costs_the_budget_only_its_uncached_tokens() -> None:
    for policy in ("fcfs", "shortest-first"):
        cache = PagedKVCache(64, 4, enable_prefix_caching=True)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, policy=policy), cache)
        shared = list(range(1, 21))                   # 5 full blocks
        sched.submit(Sequence(1, shared + [50], 1))
        while sched.has_work():
            run_step(sched)
        sched.submit(Sequence(2, shared + [60], 1))   # 20 of 21 tokens cached: computes 1
        sched.submit(Sequence(3, [70] * 6, 1))
        plan = sched.schedule()
        assert sorted(plan.admitted) == [2, 3], policy  # both fit in one step's 8 tokens
        assert shares(plan) == {2: 1, 3: 6}, policy


def test_shortest_first_prefills_a_short_prompt_before_a_long_one() -> None:
    sched = make(num_blocks=64, max_num_batched_tokens=8, policy="shortest-first")
    sched.submit(Sequence(1, [5] * 40, 1))            # arrives first, long
    sched.submit(Sequence(2, [6] * 6, 1))             # arrives second, short
    plan = sched.schedule()
    assert plan.admitted == [2, 1] and shares(plan) == {2: 6, 1: 2}
    assert plan.decode_batch == [2]                   # the short prompt's first token: step one
    fcfs = make(num_blocks=64, max_num_batched_tokens=8, policy="fcfs")
    fcfs.submit(Sequence(1, [5] * 40, 1))
    fcfs.submit(Sequence(2, [6] * 6, 1))
    assert shares(fcfs.schedule()) == {1: 8}         # fcfs: the long prompt takes the whole step


def test_shortest_first_runs_decodes_before_an_older_prefill() -> None:
    sched = make(num_blocks=64, max_num_batched_tokens=4, policy="shortest-first")
    sched.submit(Sequence(1, [5] * 30, 5))            # long prompt, admitted first
    sched.submit(Sequence(2, [6] * 2, 5))
    run_step(sched)                                   # 2 done prefilling (shortest), 1 got 2 tokens
    for _ in range(3):
        plan = sched.schedule()
        assert shares(plan) == {2: 1, 1: 3}           # 2's decode row first, 1 takes what is left
        for seq_id in plan.decode_batch:
            sched.push_token(seq_id, 9, False)


def test_shortest_first_serves_a_long_waiting_prompt_after_aging_steps() -> None:
    sched = make(num_blocks=256, max_num_batched_tokens=4, max_num_seqs=4, policy="shortest-first")
    sched.submit(Sequence(0, [5] * 12, 1))            # long; short prompts keep arriving after it
    first_step_of_0, finished = None, set()
    for step in range(1, AGING_STEPS + 5):
        sched.submit(Sequence(step, [6] * 4, 1))      # one short prompt per step fills the budget
        plan = sched.schedule()
        finished.update(plan.finished)
        for seq_id in plan.decode_batch:
            sched.push_token(seq_id, 9, False)
        if first_step_of_0 is None and 0 in shares(plan):
            first_step_of_0 = step
    assert first_step_of_0 == AGING_STEPS             # overtaken until it aged, not forever
    assert 0 in finished                              # and then ran to its end


def test_preempted_sequences_go_first_under_shortest_first() -> None:
    sched = make(num_blocks=4, block_size=2, policy="shortest-first")
    sched.submit(Sequence(1, [1, 2, 3], 5))
    sched.submit(Sequence(2, [1, 2, 3], 5))
    run_step(sched)
    run_step(sched)
    plan = sched.schedule()
    assert plan.preempted == [2]                      # the most recently admitted gives way
    for seq_id in plan.decode_batch:
        sched.push_token(seq_id, 9, False)
    sched.submit(Sequence(3, [4], 1))                 # shorter, and it would fit, but 2 goes first
    admitted: list[int] = []
    for _ in range(20):
        plan = sched.schedule()
        admitted += plan.admitted
        for seq_id in plan.decode_batch:
            sched.push_token(seq_id, 9, False)
    assert admitted[:2] == [2, 3]


def test_shortest_first_ranks_a_waiting_prompt_by_its_uncached_tokens() -> None:
    """A long prompt whose prefix was computed before costs only its tail: it goes before a shorter
    prompt that would compute all of its tokens, though it arrived later."""
    cache = PagedKVCache(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, policy="shortest-first"), cache)
    shared = list(range(1, 37))                               # 9 full blocks
    sched.submit(Sequence(1, shared + [50], 1))
    while sched.has_work():
        run_step(sched)
    sched.submit(Sequence(2, [60] * 12, 1))                   # 12 tokens, none cached
    sched.submit(Sequence(3, shared + [70, 71, 72], 1))       # 39 tokens, 36 cached: computes 3
    plan = sched.schedule()
    assert plan.admitted[0] == 3 and shares(plan)[3] == 3
    assert sched.get(3).num_cached_tokens == 36


def test_speculative_guesses_take_only_the_budget_no_prompt_can_use() -> None:
    """A decoding sequence's guesses come after every prompt's share: while a waiting prompt needs
    the rest of the step, the step carries none; once the prompts have theirs, the guesses return."""
    spec = SpeculativeConfig("ngram", num_tokens=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, policy="shortest-first", speculative=spec),
                           PagedKVCache(64, 4))
    looping = Sequence(1, [1, 2, 3] * 4, 20)          # repeats itself: the n-gram proposer always has a guess
    looping.lookahead = Lookahead(4)
    sched.submit(looping)
    assert shares(sched.schedule()) == {1: 8}
    assert shares(sched.schedule()) == {1: 4}
    sched.push_token(1, 1, False)                     # decoding now, its pattern going on
    sched.submit(Sequence(2, [9] * 10, 1))            # needs 10 tokens: more than the 7 left
    plan = sched.schedule()
    assert shares(plan) == {1: 1, 2: 7}
    assert [s.num_draft for s in plan.scheduled if s.seq_id == 1] == [0]
    sched.accept_drafts(1, 0)
    sched.push_token(1, 2, False)
    plan = sched.schedule()                           # 2 needs its last 3; 4 tokens spare
    assert shares(plan) == {1: 1, 2: 3}
    assert looping.draft == [3, 1, 2]                 # what followed the last "2 3 1 2"
    assert [s.num_draft for s in plan.scheduled if s.seq_id == 1] == [3]


def test_prompts_behind_one_new_prefix_are_one_job_computed_once() -> None:
    """A burst of prompts sharing a prefix nobody has computed: one of them computes it, early (the
    group's cost is shared out over its members), while the others wait for it instead of computing
    the same blocks; then they cost the step only their last tokens."""
    cache = PagedKVCache(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, policy="shortest-first"), cache)
    prefix = list(range(10, 22))                      # 3 full blocks
    for seq_id in (1, 2, 3):
        sched.submit(Sequence(seq_id, prefix + [seq_id], 4))
    sched.submit(Sequence(4, [50] * 10, 4))           # shorter than each of them alone
    plan = sched.schedule()
    assert plan.admitted == [1, 4] and shares(plan) == {1: 13, 4: 10}   # 2 and 3 wait for 1's blocks
    for seq_id in plan.decode_batch:
        sched.push_token(seq_id, 7, False)
    plan = sched.schedule()
    assert sorted(plan.admitted) == [2, 3]
    assert shares(plan) == {1: 1, 4: 1, 2: 1, 3: 1}  # the prefix came from the cache
    assert cache.num_prefix_hits == 2 * 12


def test_finish_retires_by_state_and_keeps_the_limit() -> None:
    """A stop retires a sequence by its state; its limit (what closing and draft budgets read) stays."""
    sched = make()
    seq = Sequence(1, [1, 2], 50)
    sched.submit(seq)
    run_step(sched)
    sched.finish(1)
    assert seq.state is SeqState.FINISHED and seq.is_complete()
    assert seq.max_new_tokens == 50 and len(seq.output) == 1
    assert sched.schedule().finished == [1] and not sched.has_work()
