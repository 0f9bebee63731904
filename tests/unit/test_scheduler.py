from __future__ import annotations

import pytest

from forge.errors import CapacityError
from forge.paged_cache import PagedKVCache
from forge.scheduler import Scheduler, SchedulerConfig, SeqState, Sequence


def make(num_blocks: int = 16, block_size: int = 4, **config: int) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), PagedKVCache(num_blocks, block_size))


def run_step(sched: Scheduler, token: int = 7) -> list[int]:
    plan = sched.schedule()
    for seq_id in plan.decode_batch:
        sched.push_token(seq_id, token, False)
    return plan.decode_batch


def test_admits_up_to_max_batch_size() -> None:
    sched = make(max_batch_size=2)
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
    assert sched.take_finished() == [1]
    assert sched.take_finished() == []
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
    sched.schedule()
    assert sched.cache().free_blocks() == 16 and not sched.has_work()
    assert sorted(sched.take_finished()) == [1, 2]


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
