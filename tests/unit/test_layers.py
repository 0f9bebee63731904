"""The import direction the design promises, checked on the source with ast.

forge/ is the core: it never reaches into the daemon (actors) or the HTTP benchmarks (forge_bench),
and stays free of asyncio, web libraries and torch. The serving path never imports the seed's toy
parts (forge.seed). The benchmark client talks to the daemon over HTTP only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_IN_CORE = ("actors", "forge_bench", "asyncio", "anyio", "starlette", "hypercorn", "httpx", "structlog",
                     "prometheus_client", "torch", "transformers")


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports by absolute name, wherever the import statement is."""
    names: set[str] = set()
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


def ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", sources("forge"), ids=ids)
def test_core_module_imports_stay_inside_the_core(path: Path) -> None:
    bad = {m for m in imported_modules(path) if m.split(".")[0] in FORBIDDEN_IN_CORE}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", [p for p in sources("forge") if "seed" not in p.parts and p.name != "cli.py"]
                         + sources("actors"), ids=ids)
def test_the_serving_path_never_imports_the_seed_toys(path: Path) -> None:
    bad = {m for m in imported_modules(path) if m == "forge.seed" or m.startswith("forge.seed.")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sources("forge_bench"), ids=ids)
def test_the_benchmark_client_does_not_reach_into_the_daemon(path: Path) -> None:
    bad = {m for m in imported_modules(path) if m.split(".")[0] == "actors"}
    assert not bad, f"{path.name} imports {sorted(bad)}"
