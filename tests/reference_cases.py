"""Running committed reference data (greedy continuations and top-5 logprobs made by transformers) through
forge's engine, and comparing: shared by the real-model reference tests and scripts/ab/kv_fidelity.py.

A reference file holds `greedy` cases (prompt_ids, output_ids, the top-2 logit gap of every step),
`logprobs` cases (prompt_ids, top5 [[id, logprob], ...]) and `num_greedy_tokens`.
"""

from __future__ import annotations

from typing import Any

import pytest

from forge.config import EngineConfig
from forge.llm import LLMEngine, LoadedModel
from forge.messages import SampledToken
from forge.sampling.sampling_params import SamplingParams

TIE_GAP = 1e-3             # below this top-2 gap, float noise may pick either token: stop comparing there
LOGPROB_TOL = 1e-3

Outputs = dict[str, tuple[list[int], list[SampledToken]]]


def run_reference(loaded: LoadedModel, data: dict[str, Any], config: EngineConfig) -> tuple[Outputs, LLMEngine]:
    """Every greedy case (past eos) and every logprob case (1 token, top 5) as one engine batch;
    returns each request's tokens and logprobs ("greedy-i", "logprobs-i") and the engine."""
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, case in enumerate(data["greedy"]):
        requests[f"greedy-{i}"] = (case["prompt_ids"], SamplingParams(
            max_tokens=data["num_greedy_tokens"], temperature=0.0, ignore_eos=True))
    for i, case in enumerate(data["logprobs"]):
        requests[f"logprobs-{i}"] = (case["prompt_ids"], SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=len(case["top5"])))
    engine = LLMEngine(loaded, config)
    outputs: Outputs = {rid: ([], []) for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_work():
        for ev in engine.step():
            outputs[ev.request_id][0].extend(ev.token_ids)
            outputs[ev.request_id][1].extend(ev.logprobs)
    return outputs, engine


def greedy_agrees(case: dict[str, Any], got: list[int]) -> bool:
    """The same tokens as the reference up to its first near-tie, and as many."""
    expected, gaps = case["output_ids"], case["top2_gap"]
    cut = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(expected))
    return len(got) == len(expected) and got[:cut] == expected[:cut]


def assert_top5_agree(top5: list[list[float]], token_ids: list[int], logprobs: list[SampledToken]) -> None:
    """One greedy token whose logprob and top 5 match the reference's within LOGPROB_TOL (only a
    near-tie at the cut may swap which token is fifth)."""
    expected = [(int(t), float(lp)) for t, lp in top5]
    assert len(token_ids) == len(logprobs) == 1
    sampled = logprobs[0]
    got = dict(sampled.top_logprobs)
    assert len(got) == len(expected)
    assert sampled.logprob == pytest.approx(expected[0][1], abs=LOGPROB_TOL)   # greedy: the top token
    if expected[0][1] - expected[1][1] >= TIE_GAP:
        assert sampled.token_id == expected[0][0]
    fifth = min(got.values())
    for token_id, logprob in expected:
        if token_id in got:
            assert got[token_id] == pytest.approx(logprob, abs=LOGPROB_TOL)
        else:
            assert logprob == pytest.approx(fifth, abs=LOGPROB_TOL)
