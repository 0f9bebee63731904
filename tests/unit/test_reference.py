"""forge against reference data from an independent float32 implementation of the default model.

tests/data/smollm2_reference.json (made by scripts/reference/make_reference.py) holds tokenizer cases, chat
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
from forge.llm import LoadedModel
from tests.reference_cases import Outputs, assert_top5_agree, greedy_agrees, run_reference

DATA_FILE = Path(__file__).resolve().parent.parent / "data" / "smollm2_reference.json"

DATA: dict[str, Any] = json.loads(DATA_FILE.read_text(encoding="utf-8"))
NUM_GREEDY = len(DATA["greedy"])


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
def engine_outputs(real: LoadedModel) -> Outputs:
    """Every greedy prompt (48 tokens, past eos) and every logprob case (1 token, top 5) together."""
    outputs, engine = run_reference(real, DATA, EngineConfig(
        kv_cache_dtype="float32",  # transformers to the bit: float32 K/V
        kv_cache_memory=512 * 2**20, max_model_len=512, max_num_seqs=len(DATA["greedy"]) + len(DATA["logprobs"]),
        max_num_batched_tokens=2048))
    assert engine.core.stats().num_preemptions == 0
    return outputs


@pytest.mark.parametrize("index", range(NUM_GREEDY), ids=[repr(c["prompt"])[:40] for c in DATA["greedy"]])
def test_greedy_matches_reference(engine_outputs: Outputs, index: int) -> None:
    assert greedy_agrees(DATA["greedy"][index], engine_outputs[f"greedy-{index}"][0])


@pytest.mark.parametrize("index", range(len(DATA["logprobs"])))
def test_top5_logprobs_match_reference(engine_outputs: Outputs, index: int) -> None:
    assert_top5_agree(DATA["logprobs"][index]["top5"], *engine_outputs[f"logprobs-{index}"])
