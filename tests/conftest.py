"""Fixtures shared by every test directory: where the real model files are.

The models are never downloaded from here: `make test` fetches them first (`make test-models`,
i.e. `forge pull`, `forge pull gemma-3-270m` and `forge pull all-minilm-l6-v2`), and a test that needs
one fails, not skips, when it is absent, so that a CI run without the models cannot pass by silently
skipping the tests that use them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forge.llm import LoadedModel
from forge.models import hub
from forge.sampling.structured import Grammars


def default_model_file() -> Path:
    """$FORGE_TEST_MODEL if set, else forge's own place for the default model under $FORGE_HOME.

    Only the path: whether the file is there is the `default_model_path` fixture's check.
    """
    if override := os.environ.get("FORGE_TEST_MODEL"):
        return Path(override).expanduser()
    return hub.default_model_path()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model's GGUF file; the test fails with how to fetch it if it is missing."""
    path = default_model_file()
    if not path.is_file():
        pytest.fail(f"the default model is not at {path}: run `make model` (or `forge pull`), "
                    "or set FORGE_TEST_MODEL to a copy of it", pytrace=False)
    return path


@pytest.fixture(scope="session")
def gemma3_model_path() -> Path:
    """The real Gemma 3 270M GGUF file (gemma3, SentencePiece, K-quants); fails with how to fetch it."""
    path = hub.model_path("gemma-3-270m")
    if not path.is_file():
        pytest.fail(f"Gemma 3 270M is not at {path}: run `make test-models` (or `forge pull gemma-3-270m`)",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def minilm_model_dir() -> Path:
    """all-MiniLM-L6-v2's unpacked directory (the BERT encoder family); fails with how to fetch it."""
    path = hub.model_path("all-minilm-l6-v2").parent / str(hub.CATALOG["all-minilm-l6-v2"].unpack_to)
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"all-MiniLM-L6-v2 is not at {path}: run `make test-models` (or `forge pull all-minilm-l6-v2`)",
                    pytrace=False)
    return path


@pytest.fixture(scope="module")
def real(default_model_path: Path) -> LoadedModel:
    """The default model loaded as forge loads it, once per test module (a module may not leave it changed
    for the next)."""
    return LoadedModel.load(default_model_path, progress=lambda message: None)


@pytest.fixture(scope="module")
def grammars(real: LoadedModel) -> Grammars:
    """The structured-output engine over the default model's tokenizer."""
    return Grammars(real.tokenizer)
