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
    """Every module the file imports by absolute name, wherever the import statement is; for `from pkg import
    x`, both pkg and pkg.x (x may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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


@pytest.mark.parametrize("path", [p for p in sources("forge") if "seed" not in p.parts and p.name != "core_cli.py"]
                         + sources("actors"), ids=ids)
def test_the_serving_path_never_imports_the_seed_toys(path: Path) -> None:
    bad = {m for m in imported_modules(path) if m == "forge.seed" or m.startswith("forge.seed.")}
    assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sources("forge_bench"), ids=ids)
def test_the_benchmark_client_does_not_reach_into_the_daemon(path: Path) -> None:
    bad = {m for m in imported_modules(path) if m.split(".")[0] == "actors"}
    assert not bad, f"{path.name} imports {sorted(bad)}"


# ---- the size and shape of the code ----------------------------------------------------------------

MAX_MODULE_LINES = 400


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The project's modules (of `known`) that `path` imports."""
    return (imported_modules(path) & known) - {module_name(path, root)}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


@pytest.mark.parametrize("path", sources("forge") + sources("actors") + sources("forge_bench"), ids=ids)
def test_no_module_grows_past_its_limit(path: Path) -> None:
    """A module past MAX_MODULE_LINES holds more than one concern: split it by concern."""
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_MODULE_LINES, f"{ids(path)} has {num_lines} lines (at most {MAX_MODULE_LINES})"


MAX_C_LINES = 800


def c_sources() -> list[Path]:
    files = sorted(p for p in (ROOT / "forge" / "kernels").rglob("*") if p.suffix in (".c", ".h"))
    assert files
    return files


@pytest.mark.parametrize("path", c_sources(), ids=ids)
def test_no_c_file_grows_past_its_limit(path: Path) -> None:
    """The compiled kernels' C files (forge/kernels/*.c, *.h) too: one past MAX_C_LINES holds more than one
    concern; split it along its sections (an instruction set, a numerics), the shared declarations in a header."""
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_C_LINES, f"{ids(path)} has {num_lines} lines (at most {MAX_C_LINES})"


def test_no_modules_import_each_other() -> None:
    """The import graph of forge/ and actors/ has no cycle, of two modules or more, counting every import
    statement wherever it stands: a lazy import hides a cycle, it does not remove it."""
    paths = {module_name(p): p for p in sources("forge") + sources("actors")}
    graph = {name: project_imports(path, set(paths)) for name, path in paths.items()}
    assert not import_cycles(graph), f"modules that import each other: {import_cycles(graph)}"


def test_the_cycle_check_sees_a_lazy_pair_and_a_longer_ring(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg.a import g\n")
    known = {"pkg", "pkg.a", "pkg.b"}
    graph = {module_name(p, tmp_path): project_imports(p, known, tmp_path) for p in (tmp_path / "pkg").glob("*.py")}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert import_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []


def test_every_module_and_class_has_one_name() -> None:
    """No two modules of forge/, actors/ and forge_bench/ share a file name (package __init__ and __main__
    aside), no class is defined twice outside forge/seed/ (the seed's names are its API), and one spelling:
    tokenizer (the seed's exported `tokeniser` aside)."""
    files = sources("forge") + sources("actors") + sources("forge_bench")
    names: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for path in files:
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.name, []).append(ids(path))
        if "seed" not in path.relative_to(ROOT).parts:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append(ids(path))
    assert not {n: p for n, p in names.items() if len(p) > 1}, names
    assert not {n: p for n, p in classes.items() if len(p) > 1}, classes
    spelled = [ids(p) for p in files if "okenis" in p.read_text() and ids(p) != "forge/seed/__init__.py"]
    assert not spelled, f"tokenizer is spelled with a z: {spelled}"
