"""The import direction the design promises, checked on the source with ast.

forge/ is the core: it never imports the daemon (actors), the HTTP benchmarks (forge_bench) or an
async or web library. The serving path never imports the seed's toy parts. The benchmark client
talks to the daemon over HTTP only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASYNC_OR_WEB = {"anyio", "asyncio", "starlette", "hypercorn", "httpx", "structlog", "prometheus_client"}


def imports(path: Path) -> set[str]:
    """Top-level names of every module the file imports, wherever the import statement is."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def sources(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return files


@pytest.mark.parametrize("path", sources("forge"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_imports_neither_the_daemon_nor_async_or_web_libraries(path: Path) -> None:
    tops = {name.split(".")[0] for name in imports(path)}
    assert not tops & ({"actors", "forge_bench"} | ASYNC_OR_WEB), path


@pytest.mark.parametrize("path", [p for p in sources("forge") if "seed" not in p.parts and p.name != "cli.py"]
                         + sources("actors"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_serving_path_never_imports_the_seed_toys(path: Path) -> None:
    assert not any(name == "forge.seed" or name.startswith("forge.seed.") for name in imports(path)), path


@pytest.mark.parametrize("path", sources("forge_bench"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_benchmark_client_does_not_reach_into_the_daemon(path: Path) -> None:
    assert not any(name.split(".")[0] == "actors" for name in imports(path)), path
