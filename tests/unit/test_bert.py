"""forge's numpy BERT encoder (forge/models/bert/) against sentence-transformers' own vectors of all-MiniLM-L6-v2
(tests/data/minilm_reference.json, made by scripts/reference/make_embedding_reference.py): the same WordPiece
ids, truncated at max_seq_length, and vectors within cosine 0.9999 of the reference's, batched or alone."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forge.errors import InvalidRequest, ModelLoadError
from forge.kernels import compiled
from forge.models.bert.bert_model import erf, gelu
from forge.models.bert.encoder import LoadedEncoder, is_encoder_dir
from forge.models.hub import CATALOG

DATA: dict[str, Any] = json.loads((Path(__file__).resolve().parent.parent / "data" / "minilm_reference.json")
                                  .read_text(encoding="utf-8"))
COSINE = 0.9999


@pytest.fixture(scope="module")
def encoder(minilm_model_dir: Path) -> LoadedEncoder:
    return LoadedEncoder.load(minilm_model_dir)


def vector(case: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(case["vector"]), dtype="<f4")


def test_the_reference_was_made_from_this_model(encoder: LoadedEncoder) -> None:
    assert DATA["model"]["sha256"] == CATALOG["all-minilm-l6-v2"].sha256
    assert encoder.max_seq_length == DATA["model"]["max_seq_length"] == 256
    assert encoder.embedding_size == DATA["model"]["dimension"] == 384
    assert len(DATA["cases"]) == 50


def test_wordpiece_ids_match_and_long_inputs_are_truncated(encoder: LoadedEncoder) -> None:
    for case in DATA["cases"]:
        assert encoder.encode(case["text"]) == case["ids"], case["text"][:40]
    assert sum(len(c["ids"]) == 256 for c in DATA["cases"]) >= 3


@pytest.mark.parametrize("compiled_gelu", [True, False], ids=["compiled", "numpy"])
def test_vectors_match_sentence_transformers_in_one_batch(minilm_model_dir: Path, compiled_gelu: bool) -> None:
    encoder = LoadedEncoder.load(minilm_model_dir)
    assert encoder.model.compiled_gelu                                      # the kernels are built here
    encoder.model.compiled_gelu = compiled_gelu
    got = encoder.embed([c["ids"] for c in DATA["cases"]])                   # [50, 384]
    for case, v in zip(DATA["cases"], got, strict=True):
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5
        assert float(v @ vector(case)) > COSINE, case["text"][:40]


def test_a_vector_does_not_depend_on_its_batch(encoder: LoadedEncoder) -> None:
    cases = DATA["cases"][:6]
    together = encoder.embed([c["ids"] for c in cases])
    for case, v in zip(cases, together, strict=True):
        alone = encoder.embed([case["ids"]])[0]
        assert float(alone @ v) > 0.999999
        assert float(alone @ vector(case)) > COSINE


def test_token_ids_are_checked_against_the_vocabulary_and_length(encoder: LoadedEncoder) -> None:
    assert encoder.check_ids([101, 7592, 102]) == [101, 7592, 102]
    with pytest.raises(InvalidRequest) as info:
        encoder.check_ids([30522])
    assert info.value.param == "input"
    with pytest.raises(InvalidRequest):
        encoder.check_ids([101] * 257, param="input[2]")


def test_erf_is_accurate_to_float32() -> None:
    x = np.linspace(-6, 6, 2001, dtype=np.float32)
    want = np.array([math.erf(float(v)) for v in x])
    assert float(np.abs(erf(x) - want).max()) < 5e-7                       # 1.5e-7, and float32 rounding


def test_the_compiled_gelu_is_the_reference_s_within_float32() -> None:
    x = np.concatenate([np.linspace(-10, 10, 20001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 3e38, -3e38], dtype=np.float32)])
    want = np.array([0.5 * float(v) * (1.0 + math.erf(float(v) / math.sqrt(2.0))) for v in x])
    got = np.empty_like(x)
    compiled.gelu_erf(x, got)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    err = np.abs(got - want) / np.maximum(1.0, np.abs(want))
    assert float(err.max()) < 1e-6
    line = x[:20001]                                    # the numpy reference's x * x overflows past 1e19
    assert float(np.abs(got[:20001] - gelu(line.copy())).max()) < 1e-5
    with pytest.raises(ValueError):
        compiled.gelu_erf(x, np.empty(3, dtype=np.float32))


def test_a_directory_that_is_not_an_encoder_is_refused(tmp_path: Path) -> None:
    assert not is_encoder_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError):
        LoadedEncoder.load(tmp_path)
