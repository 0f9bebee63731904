"""Fixtures for the integration tests: the real model, loaded once per session, fresh daemons, and the
pinned Node clients (tests/node) checked installed.

A daemon is built per test and entered with `running_daemon` inside the test body: pytest-asyncio
runs fixture setup and teardown in different tasks, so no task group may straddle a fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig
from forge.llm import LoadedModel
from tests.integration.harness import NODE_DIR, SERVED_MODEL, MakeDaemon, engine_config


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


@pytest.fixture(scope="session")
def node_clients() -> Path:
    """tests/node with every package of its lockfile installed at its locked version; fails saying how if not."""
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    stale = []
    for path, entry in lock["packages"].items():
        manifest = NODE_DIR / path / "package.json"
        if path and not entry.get("optional") and (
                not manifest.is_file() or json.loads(manifest.read_text())["version"] != entry["version"]):
            stale.append(f"{path.removeprefix('node_modules/')}@{entry['version']}")
    if stale:
        pytest.fail(f"tests/node's clients are missing or stale ({', '.join(stale[:5])}): run `make test-deps` "
                    "(or `npm ci` in tests/node)", pytrace=False)
    return NODE_DIR
