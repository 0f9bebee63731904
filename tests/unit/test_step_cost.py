"""The step-time target: a cost model learned from step timings, and the budget it gives."""

from __future__ import annotations

import pytest

from actors.daemon_cli import register
from forge.core_cli import build_parser, engine_config
from forge.engine.scheduler import MIN_PREFILL_TOKENS, SchedulerConfig
from forge.engine.sequence import Sequence
from forge.engine.step_cost import MIN_STEPS, StepCostModel
from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_scheduler import Scheduler


def test_the_model_recovers_a_linear_cost_and_follows_a_change() -> None:
    model = StepCostModel()
    assert model.fit() is None and model.tokens_within(1.0) is None
    for i in range(40):
        tokens = 32 + 16 * (i % 8)
        model.observe(tokens, 0.010 + 0.001 * tokens)            # 10 ms + 1 ms a token
    fixed, per_token = model.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.010, rel=1e-6) and per_token == pytest.approx(0.001, rel=1e-6)
    assert model.tokens_within(0.110) == 100
    for i in range(200):                                          # the machine got twice as slow
        tokens = 32 + 16 * (i % 8)
        model.observe(tokens, 2 * (0.010 + 0.001 * tokens))
    assert model.tokens_within(0.220) == pytest.approx(100, abs=2)


def test_steps_of_one_size_give_a_cost_through_the_origin() -> None:
    model = StepCostModel()
    for _ in range(MIN_STEPS):
        model.observe(32, 0.064)
    assert model.fit() == (0.0, pytest.approx(0.002))
    assert model.tokens_within(0.1) == 50


def decoding_scheduler(max_step_s: float | None, num_decoding: int) -> Scheduler:
    """num_decoding sequences past their prefill, and one long prompt waiting."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_step_s=max_step_s,
                                           policy="shortest-first"), PagedKVCache(512, 16))
    for i in range(num_decoding):
        sched.submit(Sequence(i, [5, 6, 7], 50))
    sched.schedule()                                              # their prompts, in one step
    for i in range(num_decoding):
        sched.push_token(i, 9, False)
    sched.submit(Sequence(999, list(range(1000)), 10))
    for tokens in (64, 128, 256, 512):
        sched.observe_step(tokens, 0.020 + 0.002 * tokens)       # 20 ms + 2 ms a token
    return sched


def test_a_step_time_target_limits_the_prompt_chunk_while_streams_decode() -> None:
    plan = decoding_scheduler(0.120, num_decoding=8).schedule()    # (120 - 20) / 2 = 50 tokens fit
    chunks = {s.seq_id: s.num_tokens for s in plan.scheduled}
    assert all(chunks[i] == 1 for i in range(8)) and plan.num_tokens == 50
    assert chunks[999] == 50 - 8


def test_without_a_target_the_token_budget_rules() -> None:
    plan = decoding_scheduler(None, num_decoding=8).schedule()
    assert plan.num_tokens == 512


def test_prompts_advance_even_when_the_decode_rows_alone_exceed_the_target() -> None:
    plan = decoding_scheduler(0.030, num_decoding=8).schedule()    # 5 tokens fit: fewer than 8 rows
    chunks = {s.seq_id: s.num_tokens for s in plan.scheduled}
    assert chunks[999] == MIN_PREFILL_TOKENS and plan.num_tokens == 8 + MIN_PREFILL_TOKENS


def test_with_nothing_decoding_a_prompt_takes_the_whole_budget() -> None:
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_step_s=0.05), PagedKVCache(512, 16))
    for tokens in (64, 128, 256, 512):
        sched.observe_step(tokens, 0.020 + 0.002 * tokens)
    sched.submit(Sequence(1, list(range(1000)), 10))
    assert sched.schedule().num_tokens == 512


def test_the_serve_flag_defaults_to_300_ms_and_takes_off(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("FORGE_MAX_STEP_MS", raising=False)
    parser = build_parser(register)
    assert parser.parse_args(["serve"]).max_step_ms == 300.0
    assert parser.parse_args(["serve", "--max-step-ms", "off"]).max_step_ms is None
    assert parser.parse_args(["serve", "--max-step-ms", "200"]).max_step_ms == 200.0
    for bad in ("0", "-5", "fast"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["serve", "--max-step-ms", bad])
        assert exited.value.code == 2
        assert "--max-step-ms" in capsys.readouterr().err
    monkeypatch.setenv("FORGE_MAX_STEP_MS", "off")
    assert build_parser(register).parse_args(["serve"]).max_step_ms is None


def test_forge_serve_commits_the_kv_cache_by_default_and_generate_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FORGE_KV_CACHE_COMMIT", raising=False)
    parser = build_parser(register)
    assert engine_config(parser.parse_args(["serve"])).kv_cache_commit
    assert not engine_config(parser.parse_args(["serve", "--kv-cache-commit", "off"])).kv_cache_commit
    assert not engine_config(parser.parse_args(["generate", "hello"])).kv_cache_commit
    monkeypatch.setenv("FORGE_KV_CACHE_COMMIT", "off")
    assert not engine_config(build_parser(register).parse_args(["serve"])).kv_cache_commit
