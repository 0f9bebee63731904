"""forge against reference data from an independent float32 implementation of the default model.

tests/data/smollm2_reference.json (made by scripts/make_reference.py) holds tokenizer cases, chat
renderings, greedy continuations with the top-2 logit gap of every step, and top-5 logprobs.
The model file must be installed (tests/conftest.py); the greedy and logprob cases run as one engine batch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from forge.config import EngineConfig
from forge.llm import LLMEngine, LoadedModel
from forge.messages import SampledToken
from forge.sampling_params import SamplingParams

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "smollm2_reference.json"
TIE_GAP = 1e-3             # below this top-2 gap, float noise may pick either token: stop comparing there
LOGPROB_TOL = 1e-3

DATA: dict[str, Any] = json.loads(DATA_FILE.read_text(encoding="utf-8"))
NUM_GREEDY = len(DATA["greedy"])


@pytest.fixture(scope="module")
def real(default_model_path: Path) -> LoadedModel:
    return LoadedModel.load(default_model_path, progress=lambda message: None)


def test_model_file_is_the_one_the_reference_was_made_from(real: LoadedModel) -> None:
    digest = hashlib.sha256()
    with open(real.path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    assert digest.hexdigest() == DATA["model"]["sha256"]


# ---- tokenizer and chat template ------------------------------------------------------------

def _tokenizer_case(case: dict[str, Any]) -> Any:
    return pytest.param(case, id=repr(case["text"])[:40])


@pytest.mark.parametrize("case", [_tokenizer_case(c) for c in DATA["tokenizer"]])
def test_encode_matches_reference(real: LoadedModel, case: dict[str, Any]) -> None:
    assert real.tokenizer.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", DATA["greedy"], ids=lambda c: repr(c["prompt"])[:40])
def test_encode_of_greedy_prompts_matches_reference(real: LoadedModel, case: dict[str, Any]) -> None:
    assert real.tokenizer.encode(case["prompt"]) == case["prompt_ids"]


def test_bytes_without_a_token_match_reference(real: LoadedModel) -> None:
    tok = real.tokenizer
    single = {tok.token_bytes(i) for i in range(tok.vocab_size) if i not in tok.special_ids}
    missing = [b for b in range(256) if bytes((b,)) not in single]
    assert missing == DATA["bytes_without_token"]


@pytest.mark.parametrize("case", DATA["chat"], ids=lambda c: repr(c["messages"][-1]["content"])[:40])
def test_chat_rendering_matches_reference(real: LoadedModel, case: dict[str, Any]) -> None:
    text = real.chat_template.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert text == case["text"]
    assert real.tokenizer.encode(text) == case["ids"]


# ---- the forward: greedy continuations and logprobs, in one batch ----------------------------

@pytest.fixture(scope="module")
def engine_outputs(real: LoadedModel) -> dict[str, tuple[list[int], list[SampledToken]]]:
    """Every greedy prompt (48 tokens, past eos) and every logprob case (1 token, top 5) together."""
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    for i, case in enumerate(DATA["greedy"]):
        requests[f"greedy-{i}"] = (case["prompt_ids"], SamplingParams(
            max_tokens=DATA["num_greedy_tokens"], temperature=0.0, ignore_eos=True))
    for i, case in enumerate(DATA["logprobs"]):
        requests[f"logprobs-{i}"] = (case["prompt_ids"], SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=len(case["top5"])))
    engine = LLMEngine(real, EngineConfig(kv_cache_memory=512 * 2**20, max_model_len=512,
                                          max_num_seqs=len(requests), max_num_batched_tokens=2048))
    outputs: dict[str, tuple[list[int], list[SampledToken]]] = {rid: ([], []) for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    while engine.has_work():
        for ev in engine.step():
            outputs[ev.request_id][0].extend(ev.token_ids)
            outputs[ev.request_id][1].extend(ev.logprobs)
    assert engine.core.stats().num_preemptions == 0
    return outputs


@pytest.mark.parametrize("index", range(NUM_GREEDY), ids=[repr(c["prompt"])[:40] for c in DATA["greedy"]])
def test_greedy_matches_reference(engine_outputs: dict[str, tuple[list[int], list[SampledToken]]],
                                  index: int) -> None:
    case = DATA["greedy"][index]
    expected, gaps = case["output_ids"], case["top2_gap"]
    got = engine_outputs[f"greedy-{index}"][0]
    assert len(got) == len(expected)
    cut = next((i for i, gap in enumerate(gaps) if gap < TIE_GAP), len(expected))
    assert got[:cut] == expected[:cut]


@pytest.mark.parametrize("index", range(len(DATA["logprobs"])))
def test_top5_logprobs_match_reference(engine_outputs: dict[str, tuple[list[int], list[SampledToken]]],
                                       index: int) -> None:
    expected = [(int(t), float(lp)) for t, lp in DATA["logprobs"][index]["top5"]]
    token_ids, logprobs = engine_outputs[f"logprobs-{index}"]
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
        else:                   # only a near-tie at the cut may swap which token is fifth
            assert logprob == pytest.approx(fifth, abs=LOGPROB_TOL)
