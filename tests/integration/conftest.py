"""Fixtures for the integration tests: the real model, loaded once per session, and fresh daemons.

A daemon is built per test and entered with `running_daemon` inside the test body: pytest-asyncio
runs fixture setup and teardown in different tasks, so no task group may straddle a fixture.
"""

from __future__ import annotations

from typing import Any

import pytest

from actors.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig
from forge.llm import LoadedModel
from tests.integration.harness import MODEL_PATH, SERVED_MODEL, MakeDaemon, engine_config


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    if not MODEL_PATH.is_file():
        pytest.skip(f"the real model is not at {MODEL_PATH} (run `forge pull`)")
    return LoadedModel.load(MODEL_PATH, progress=lambda message: None)


@pytest.fixture
def make_daemon(loaded: LoadedModel) -> MakeDaemon:
    """make_daemon(engine overrides..., gateway=dict(...), drain_timeout=...) -> a fresh Daemon."""

    def make(*, gateway: dict[str, Any] | None = None, drain_timeout: float = 5.0,
             **engine: Any) -> Daemon:
        gateway_config = GatewayConfig(**{"served_model_name": SERVED_MODEL, **(gateway or {})})
        config = DaemonConfig(engine=engine_config(**engine), gateway=gateway_config,
                              model=str(MODEL_PATH), drain_timeout=drain_timeout)
        return Daemon(config, loaded)

    return make
