"""The reference docs against the code's own definitions, so that they cannot drift:
docs/configuration.md has every `forge serve` flag with the environment variable and default its
help names (and no flag forge lacks); docs/api.md's field table has every request field of the
routes that take it. A flag or field added, renamed or re-defaulted without its doc fails here."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path

import msgspec
import pytest

from actors.daemon_cli import register
from forge.api.openai.openai_schema import ChatCompletionRequest, CompletionRequest
from forge.core_cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# "[FORGE_X; default]" or "[FORGE_X]" or "[FORGE_X=0]" at the end of a flag's help
HELP_TAIL = re.compile(r"\[(FORGE_[A-Z_]+)(=\S+)?(?:; ([^\]]+))?\]\s*$")


def serve_flags(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, str | None]]:
    """--flag -> (variable, default as its help states it), from the parser with no FORGE_ set."""
    for name in [n for n in os.environ if n.startswith("FORGE_")]:
        monkeypatch.delenv(name)
    parser = build_parser(register)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for action in sub.choices["serve"]._actions:
        flag = next((s for s in action.option_strings if s.startswith("--")), None)
        if flag is None or flag == "--help":
            continue
        match = HELP_TAIL.search(action.help or "")
        assert match is not None, f"{flag}'s help does not end with [FORGE_VARIABLE; default]: {action.help!r}"
        variable = match.group(1) + (match.group(2) or "")
        out[flag] = (variable, match.group(3))
    return out


def documented() -> dict[str, tuple[str, str]]:
    """--flag -> (variable, default) from the reference tables of docs/configuration.md."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`--"):
            continue
        flag = cells[0].strip("`").split()[0]
        rows[flag] = (cells[1].strip("`"), cells[2].replace("`", ""))
    return rows


def test_every_serve_flag_is_documented_with_its_variable_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    flags, doc = serve_flags(monkeypatch), documented()
    assert set(flags) == set(doc), (f"in the code only: {sorted(set(flags) - set(doc))}; "
                                    f"in docs/configuration.md only: {sorted(set(doc) - set(flags))}")
    for flag, (variable, default) in flags.items():
        doc_variable, doc_default = doc[flag]
        assert doc_variable == variable, f"{flag}: the doc says {doc_variable}, the code reads {variable}"
        assert default is not None, f"{flag}'s help names no default"
        assert doc_default == default, f"{flag}: the doc's default is {doc_default!r}, the help's {default!r}"


def test_the_help_defaults_are_the_parsers_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default a help string states is the one argparse uses (for one-word defaults)."""
    flags = serve_flags(monkeypatch)
    parser = build_parser(register)
    args = parser.parse_args(["serve"])
    for flag, (_, default) in flags.items():
        if default is None or " " in default:
            continue
        value = getattr(args, flag[2:].replace("-", "_"))
        shown = ("off", "none") if value is None else (str(value),)
        assert default in shown or (isinstance(value, float) and float(default) == value), (flag, value, default)


API_DOC = DOC.parent / "api.md"


def documented_fields() -> dict[str, tuple[bool, bool]]:
    """field -> (on completions, on chat) from the "Request fields" table of docs/api.md."""
    text = API_DOC.read_text()
    table = text[text.index("## Request fields"):]
    table = table[:table.index("\n## ")]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_]+)`", cells[0]):
                out[name] = (cells[1] == "✓", cells[2] == "✓")
    return out


def test_every_request_field_is_in_the_api_reference_for_the_routes_that_take_it() -> None:
    completion = {f.name for f in msgspec.structs.fields(CompletionRequest)}
    chat = {f.name for f in msgspec.structs.fields(ChatCompletionRequest)}
    doc = documented_fields()
    assert set(doc) == completion | chat, (f"in the code only: {sorted((completion | chat) - set(doc))}; "
                                           f"in docs/api.md only: {sorted(set(doc) - (completion | chat))}")
    for name, (on_completions, on_chat) in doc.items():
        assert (name in completion, name in chat) == (on_completions, on_chat), name


# ---- every path the docs name exists ------------------------------------------------------------

ROOT = DOC.parents[1]
# docs/benchmarks-history.md is a record of what was measured when: it names files as they were then.
MAPS = [p for p in sorted(ROOT.glob("docs/*.md")) if p.name != "benchmarks-history.md"] + [ROOT / "README.md"]
TOP = ("forge", "actors", "tests", "scripts", "deploy", "docs", "forge_bench", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*[\w/])")
# forge.llm.LLM, not forge.service (a unit file) nor forge.example.com
DOTTED = re.compile(r"(?<![\w./-])((?:forge|actors)(?:\.[A-Za-z_]\w*)+)(?![\w-])")
BARE = re.compile(r"(?<![\w/.-])([\w-]+\.(?:py|c|h|sh|html|service|socket|conf|toml))\b")


def _named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return [(doc.name, m.group(1).rstrip(".")) for doc in MAPS for m in pattern.finditer(doc.read_text())]


def test_every_path_the_docs_name_exists() -> None:
    """forge/engine/core.py, scripts/peer/, deploy/forge.service...: a module moved or renamed without
    its docs fails here."""
    missing = sorted({(doc, path) for doc, path in _named(PATH) if not (ROOT / path).exists()})
    assert not missing, missing


def test_every_module_the_docs_name_by_its_dotted_name_exists() -> None:
    """forge.llm.LLM, actors.runtime.kv_publisher: a dotted name whose first two parts are a module or package
    of forge/ or actors/ imports, and the rest are its attributes (forge.example.com, a host, is not one)."""
    def is_module(parts: list[str]) -> bool:
        path = ROOT.joinpath(*parts)
        return path.with_suffix(".py").exists() or (path / "__init__.py").exists()

    def resolves(dotted: str) -> bool:
        parts = dotted.split(".")
        depth = max(i for i in range(2, len(parts) + 1) if is_module(parts[:i]))
        obj: object = importlib.import_module(".".join(parts[:depth]))
        for attr in parts[depth:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True

    named = {(doc, name) for doc, name in _named(DOTTED) if is_module(name.split(".")[:2])}
    missing = sorted((doc, name) for doc, name in named if not resolves(name))
    assert named and not missing, missing


def test_every_file_the_docs_name_alone_is_in_the_tree() -> None:
    """A file named without its folder (llama_model.py, qmatmul.c, forge.service): some file of the tree
    has that name (module names are unique across the tree: tests/unit/test_layers.py)."""
    names = {p.name for top in TOP for p in (ROOT / top).rglob("*")} | {p.name for p in ROOT.iterdir()}
    missing = sorted({(doc, name) for doc, name in _named(BARE) if name not in names})
    assert not missing, missing
