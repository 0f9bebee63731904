"""Fixtures shared by every test directory: where the real default model file is.

The model is never downloaded from here: `make test` fetches it first (`make model`, i.e.
`forge pull`), and a test that needs it fails, not skips, when it is absent, so that a CI run
without the model cannot pass by silently skipping the tests that use it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forge import hub


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
