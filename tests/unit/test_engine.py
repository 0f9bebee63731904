from __future__ import annotations

import pytest

import forge.seed.toy_engine
from forge.errors import EngineError
from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_engine import Engine
from forge.seed.toy_model import TinyTransformer
from forge.seed.toy_scheduler import SchedulerConfig


def greedy(model: TinyTransformer, prompt: list[int], max_new: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_new:
        token = model.forward(prompt + out).argmax()
        out.append(token)
        if token == model.eos_token:
            break
    return out


def test_outputs_equal_plain_greedy_whatever_the_batching() -> None:
    model = TinyTransformer(320, 2)
    prompts = {i: [1 + (i * 7 + j) % 250 for j in range(3 + i % 9)] for i in range(12)}
    engine = Engine(model, SchedulerConfig(max_batch_size=4), PagedKVCache(12, 4))
    for i, prompt in prompts.items():
        engine.submit(i, prompt, 20)
    outputs = engine.run_to_completion()
    assert [o.id for o in outputs] == sorted(prompts)
    for o in outputs:
        assert o.tokens == greedy(model, prompts[o.id], 20)
    assert engine.scheduler.num_preemptions > 0           # the cache was tight on purpose
    assert engine.scheduler.cache().free_blocks() == 12


def test_step_reports_eos() -> None:
    model = TinyTransformer(320, 1)
    model.pin([5, 6], 0)
    engine = Engine(model, SchedulerConfig(), PagedKVCache(8, 4))
    engine.submit(1, [5, 6], 10)
    assert engine.step() == [(1, 0, True)]
    assert engine.run_to_completion()[0].tokens == [0]


def test_iteration_guard_raises_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forge.seed.toy_engine, "MAX_ITERATIONS", 5)
    engine = Engine(TinyTransformer(320, 1), SchedulerConfig(), PagedKVCache(64, 4))
    engine.submit(1, [1, 2], 100)
    with pytest.raises(EngineError, match="5 iterations"):
        engine.run_to_completion()
