"""The real Gemma 3 270M file (gemma3, SentencePiece with byte fallback, Q4_K/Q5_0/Q6_K/Q8_0 tensors)
against Hugging Face transformers loading the same GGUF.

tests/data/gemma3_270m_reference.json (scripts/reference/make_family_reference.py) holds tokenizer cases,
greedy continuations with the top-2 logit gap of every step (one prompt of 619 tokens, past the
512-token sliding window) and top-5 logprobs. The greedy and logprob cases run as one engine batch
on the default kernels (the file's blocks kept quantized).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from forge.config import EngineConfig
from forge.llm import LoadedModel
from tests.reference_cases import Outputs, assert_top5_agree, greedy_agrees, run_reference

DATA: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parent.parent / "data" / "gemma3_270m_reference.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gemma(gemma3_model_path: Path) -> LoadedModel:
    return LoadedModel.load(gemma3_model_path, progress=lambda message: None)


def test_what_the_file_is(gemma: LoadedModel) -> None:
    c, tok = gemma.model.config, gemma.tokenizer
    assert (c.arch.name, c.num_layers, c.hidden_size, c.head_dim, c.sliding_window) == ("gemma3", 18, 640, 256, 512)
    assert [c.is_sliding(i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [False]
    assert (tok.kind, tok.vocab_size, tok.add_bos, tok.add_space_prefix) == ("spm", 262144, True, False)
    assert (tok.bos_token_id, tok.eos_token_id) == (2, 1)
    assert tok.missing_bytes == frozenset()                       # every byte has its <0xXX> piece
    assert gemma.kernels.name != "numpy" and not gemma.model.weights.is_dense  # the blocks kept quantized


@pytest.mark.parametrize("case", DATA["tokenizer"], ids=lambda c: repr(c["text"])[:40])
def test_encode_matches_reference(gemma: LoadedModel, case: dict[str, Any]) -> None:
    assert gemma.tokenizer.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", DATA["tokenizer"], ids=lambda c: repr(c["text"])[:40])
def test_decode_round_trips(gemma: LoadedModel, case: dict[str, Any]) -> None:
    tok = gemma.tokenizer
    text = tok.decode(case["ids"], skip_special_tokens=False).removeprefix("<bos>")
    assert text == case["text"]
    assert b"".join(tok.token_bytes(i) for i in case["ids"][1:]) == case["text"].encode()


@pytest.fixture(scope="module")
def engine_outputs(gemma: LoadedModel) -> Outputs:
    outputs, engine = run_reference(gemma, DATA, EngineConfig(
        kv_cache_dtype="float32",  # transformers to the bit: float32 K/V
        kv_cache_memory=512 * 2**20, max_model_len=1024, max_num_seqs=len(DATA["greedy"]) + len(DATA["logprobs"]),
        max_num_batched_tokens=1024))
    assert engine.core.stats().num_preemptions == 0
    return outputs


@pytest.mark.parametrize("index", range(len(DATA["greedy"])), ids=[repr(c["prompt"])[-30:] for c in DATA["greedy"]])
def test_greedy_matches_reference(engine_outputs: Outputs, index: int) -> None:
    assert greedy_agrees(DATA["greedy"][index], engine_outputs[f"greedy-{index}"][0])


@pytest.mark.parametrize("index", range(len(DATA["logprobs"])))
def test_top5_logprobs_match_reference(engine_outputs: Outputs, index: int) -> None:
    assert_top5_agree(DATA["logprobs"][index]["top5"], *engine_outputs[f"logprobs-{index}"])
