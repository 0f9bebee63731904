"""Fixtures for the integration tests: the real model, loaded once per session, and fresh daemons.

A daemon is built per test and entered with `running_daemon` inside the test body: pytest-asyncio
runs fixture setup and teardown in different tasks, so no task group may straddle a fixture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig
from forge.llm import LoadedModel
from tests.integration.harness import SERVED_MODEL, MakeDaemon, engine_config


@pytest.fixture(scope="session")
def loaded(default_model_path: Path) -> LoadedModel:
    return LoadedModel.load(default_model_path, progress=lambda message: None)


@pytest.fixture
def make_daemon(loaded: LoadedModel, default_model_path: Path) -> MakeDaemon:
    """make_daemon(engine overrides..., gateway=dict(...), drain_timeout=...) -> a fresh Daemon."""

    def make(*, gateway: dict[str, Any] | None = None, drain_timeout: float = 5.0,
             **engine: Any) -> Daemon:
        gateway_config = GatewayConfig(**{"served_model_name": SERVED_MODEL, **(gateway or {})})
        config = DaemonConfig(engine=engine_config(**engine), gateway=gateway_config,
                              model=str(default_model_path), drain_timeout=drain_timeout)
        return Daemon(config, loaded)

    return make
