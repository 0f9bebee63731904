"""How deep a request's JSON schemas and grammars nest, measured without recursion, and the bounds forge holds
them to before anything that recurses (forge's schema walkers, json, the chat template, llguidance's compiler)
sees them. Pure: no I/O.

Why bounds at all (docs/reliability.md, "Input nobody should send"): forge's own schema walkers and json
recurse in Python (RecursionError past ~1,000 levels); llguidance reads JSON with serde_json, which stops at
128 levels; and llguidance's grammar compiler recurses once per level of rule and $ref nesting, overflowing an
8 MiB thread stack (SIGSEGV: the whole daemon dies) at 2,500-3,000 levels, which a 60 KB grammar reaches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from forge.errors import InvalidRequest

# Objects and arrays nested in one JSON schema, a $ref counted as the nesting of what it points to. Under
# serde_json's 128 with room for what forge wraps a schema in (the grammar's envelope, 3 levels; a tool call's
# object and the anyOf of several tools, 5), and far above real schemas: pydantic nests models through $refs,
# 3-5 levels a model, so 100 is 20 models deep.
MAX_SCHEMA_DEPTH = 100
# Levels of rule nesting in one grammar: along its deepest chain of rule references, each rule's own bracket
# nesting plus one (a %json schema inside counted as its depth). A third of where llguidance's compiler
# overflowed an 8 MiB stack (2,600-3,000 levels measured, rule chains and $ref chains alike).
MAX_GRAMMAR_DEPTH = 1000


def check_schema(schema: Any, *, param: str) -> None:
    """Raise InvalidRequest naming MAX_SCHEMA_DEPTH if `schema` nests deeper."""
    if schema_depth(schema, limit=MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"the JSON schema nests too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects "
                             "and arrays, each $ref counted as what it points to)", param=param)


def check_grammar(lark: str, *, param: str) -> None:
    """Raise InvalidRequest naming MAX_GRAMMAR_DEPTH if the Lark grammar `lark` nests deeper."""
    if grammar_depth(lark, limit=MAX_GRAMMAR_DEPTH) > MAX_GRAMMAR_DEPTH:
        raise InvalidRequest(f"the grammar nests too deeply (more than {MAX_GRAMMAR_DEPTH} levels of rules and "
                             "brackets along one chain of rule references)", param=param)


# ---- JSON schemas ----------------------------------------------------------------------------------------

def schema_depth(schema: Any, *, limit: int | None = None) -> int:
    """Objects and arrays nested in `schema` (a scalar: 0), where a local "$ref" ("#", "#/$defs/x") counts as
    the nesting of its target, as if written in place; a reference back into its own path (a recursive schema)
    counts once. Stops early, returning more than `limit`, once past it."""
    if not isinstance(schema, dict | list):
        return 0
    done: dict[int, int] = {}             # id(container) -> its depth
    on_path: set[int] = set()
    stack: list[tuple[Any, Iterator[Any], list[int]]] = [(schema, _children(schema, schema), [0])]
    on_path.add(id(schema))
    while stack:
        node, children, deepest = stack[-1]
        if limit is not None and len(stack) > limit:
            return len(stack)
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            done[id(node)] = depth = 1 + deepest[0]
            if stack:
                stack[-1][2][0] = max(stack[-1][2][0], depth)
            continue
        known = done.get(id(child))
        if known is not None:
            deepest[0] = max(deepest[0], known)
        elif id(child) not in on_path:                      # on the path: a recursive reference, counted once
            on_path.add(id(child))
            stack.append((child, _children(child, schema), [0]))
    return done[id(schema)]


def _children(node: Any, root: Any) -> Iterator[Any]:
    """The containers directly inside `node`, and the target of its "$ref" if it has a local one."""
    values = node.values() if isinstance(node, dict) else node
    for value in values:
        if isinstance(value, dict | list):
            yield value
    if isinstance(node, dict) and isinstance(ref := node.get("$ref"), str):
        target = _resolve(ref, root)
        if isinstance(target, dict | list):
            yield target


def _resolve(ref: str, root: Any) -> Any:
    """What a local JSON pointer reference ("#", "#/a/0/b") names in `root`, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


# ---- Lark grammars ---------------------------------------------------------------------------------------

# A definition opens a line: `name:`, `?name:`, `!name.2:`, `NAME:` (rules and terminals alike).
_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:", re.MULTILINE)
# The tokens of a definition's body that matter here; strings, regexes, comments and special tokens are
# skipped whole so that the brackets inside them do not count.
_TOKEN = re.compile(r'''
    (?P<skip> "(?:[^"\\\n]|\\.)*" | '(?:[^'\\\n]|\\.)*'        # strings
            | //[^\n]*                                          # a comment
            | /(?:[^/\\\n\[]|\\.|\[(?:[^\]\\\n]|\\.)*\])+/      # a regex ([/] inside a class)
            | <[^<>\n]*> )                                      # a special token: <|eos|>, <[128]>
  | (?P<json> %json\b )
  | (?P<name> [A-Za-z_]\w* )
  | (?P<open> [(\[{] )
  | (?P<close> [)\]}] )
''', re.VERBOSE)


def grammar_depth(lark: str, *, limit: int | None = None) -> int:
    """The deepest chain of rule references in the Lark grammar `lark`, each rule along it counted as one
    plus its own bracket nesting (or the depth of a %json schema in it, if deeper); a reference back into the
    chain (a recursive rule) counts once. A conservative measure of how deep llguidance's compiler recurses."""
    weights: dict[str, int] = {}
    refs: dict[str, set[str]] = {}
    starts = list(_DEFINITION.finditer(lark))
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(lark)
        weight, names = _body(lark, match.end(), end)
        name = match.group(1)
        weights[name] = max(weights.get(name, 0), weight)
        refs.setdefault(name, set()).update(names)
    return _longest_chain(weights, refs, limit)


def _body(text: str, start: int, end: int) -> tuple[int, set[str]]:
    """One definition's weight (1 + its bracket nesting, or + a %json schema's depth) and the names it uses."""
    nesting = deepest = 0
    names: set[str] = set()
    pos = start
    while (token := _TOKEN.search(text, pos, end)) is not None:
        pos = token.end()
        kind = token.lastgroup
        if kind == "name":
            names.add(token.group())
        elif kind == "open":
            nesting += 1
            deepest = max(deepest, nesting)
        elif kind == "close":
            nesting = max(0, nesting - 1)
        elif kind == "json":
            schema, pos = _json_at(text, pos, end)
            deepest = max(deepest, nesting + schema_depth(schema))
    return 1 + deepest, names


def _json_at(text: str, pos: int, end: int) -> tuple[Any, int]:
    """The JSON value after a %json directive and where it ends; (None, pos) if none reads there (llguidance
    will say what is wrong)."""
    while pos < end and text[pos].isspace():
        pos += 1
    try:
        value, stop = json.JSONDecoder().raw_decode(text[:end], pos)
    except (ValueError, RecursionError):
        return None, pos
    return value, stop


def _longest_chain(weights: dict[str, int], refs: dict[str, set[str]], limit: int | None) -> int:
    """The heaviest path through the rule graph from any rule, a rule already on the path not entered again;
    iterative, each rule's total computed once. Stops early, returning more than `limit`, once past it."""
    total: dict[str, int] = {}
    best = 0
    for root in weights:
        if root in total:
            continue
        on_path = {root}
        stack: list[tuple[str, Iterator[str], list[int]]] = [(root, iter(sorted(refs[root])), [0])]
        path_weight = weights[root]
        while stack:
            if limit is not None and path_weight > limit:
                return path_weight
            name, children, heaviest = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                on_path.discard(name)
                path_weight -= weights[name]
                total[name] = weights[name] + heaviest[0]
                if stack:
                    stack[-1][2][0] = max(stack[-1][2][0], total[name])
                continue
            if child not in weights or child in on_path:
                continue
            if child in total:
                heaviest[0] = max(heaviest[0], total[child])
                if limit is not None and path_weight + total[child] > limit:
                    return path_weight + total[child]
                continue
            on_path.add(child)
            path_weight += weights[child]
            stack.append((child, iter(sorted(refs[child])), [0]))
        best = max(best, total[root])
    return best
