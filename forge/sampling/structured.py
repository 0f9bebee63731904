"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) as a grammar, and the
per-step token masks that keep a sequence inside it.

The grammar engine is llguidance (docs/design.md, "Constrained decoding": chosen by an A/B against
outlines-core on forge's tokenizer). A constraint travels as llguidance's own grammar text (a str in
SamplingParams, so messages stay plain data); `Grammars` checks it against the model's vocabulary at
the edge and makes one matcher per sequence for the model worker, caching compiled grammars by text.
Masks are bitmasks over the tokenizer's vocabulary ([rows, ceil(V / 32)] int32), filled for a whole
batch at once by llguidance's own threads (the GIL released).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import llguidance
import llguidance.numpy as llnp
import numpy as np
import numpy.typing as npt

from forge.errors import InvalidRequest
from forge.sampling.nesting import MAX_SCHEMA_DEPTH, check_grammar, check_schema
from forge.text.tokenizer import Tokenizer

I32 = npt.NDArray[np.int32]
BoolArray = npt.NDArray[np.bool_]
_V = TypeVar("_V")

MAX_CONSTRAINT_CHARS = 128 * 1024      # a schema, regex or grammar longer than this is refused
_CACHE_SIZE = 256                      # compiled grammars kept per process (LRU)

# JSON is generated compact (", " and ": ", no free whitespace): a small model given free whitespace
# can spend its whole max_tokens on newlines. A schema's own "x-guidance" options override these.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# A JSON output closes itself within max_tokens: over its last CLOSE_WITHIN tokens (a quarter of max_tokens at
# most), of the tokens the grammar allows the runner keeps those that close something (a string, an array, an
# object, the output) whenever there are any, so a small model looping over array items or keys still ends
# with a document that parses (docs/api.md, "Outputs that finish"; the figure chosen by
# scripts/ab/library_parse_rates.py: 8 tokens parsed 16-20 of 20 per library mode, 16 19-20, 32 all 20).
CLOSE_WITHIN = 32
_CLOSERS = frozenset(b"]} \t\r\n")


# ---- request side: constraint -> grammar text ------------------------------------------------------------

def json_schema_grammar(schema: Any, *, whitespace_pattern: str | None = None, strict: bool = False,
                        param: str) -> str:
    """The grammar of JSON documents valid under `schema` (a dict, or a JSON string of one), under OpenAI's
    strict semantics if `strict` (strict_schema). A schema nested deeper than MAX_SCHEMA_DEPTH is refused
    before anything recursive reads it."""
    if isinstance(schema, str):
        _check_size(schema, param)
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", param=param) from None
        except RecursionError:
            raise InvalidRequest(f"the JSON schema nests too deeply (more than {MAX_SCHEMA_DEPTH} levels of "
                                 "objects and arrays)", param=param) from None
    if isinstance(schema, bool):                                   # true: any JSON value; false: nothing
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest("the JSON schema must be an object", param=param)
    check_schema(schema, param=param)
    schema = enforced_schema(strict_schema(schema) if strict else schema)
    options = dict(JSON_OPTIONS)
    if whitespace_pattern is not None:
        options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    guidance = schema.get("x-guidance")
    schema = {**schema, "x-guidance": {**options, **(guidance if isinstance(guidance, dict) else {})}}
    text = json.dumps(schema)
    _check_size(text, param)
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(text))
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}", param=param) from None


# Keywords whose values are schemas, or lists or maps of schemas: where _each_schema looks for subschemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _each_schema(schema: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """fn applied to every (sub)schema of `schema`, innermost first, into a new schema; booleans and
    non-schemas pass through."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = _each_schema(out[key], fn)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_each_schema(s, fn) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _each_schema(s, fn) for name, s in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _each_schema(out["additionalProperties"], fn)
    return fn(out)


def _has_type(schema: dict[str, Any], name: str) -> bool:
    kind = schema.get("type")
    return kind == name or (isinstance(kind, list) and name in kind)


def strict_schema(schema: Any) -> Any:
    """`schema` under OpenAI's strict semantics (`"strict": true`): every object schema (a "type"
    of "object", or "properties" given) that does not say additionalProperties is closed, and one
    without "required" requires all its listed properties; what a schema says itself stands. A new
    schema."""
    def close(s: dict[str, Any]) -> dict[str, Any]:
        if _has_type(s, "object") or "properties" in s:
            s.setdefault("additionalProperties", False)
            if isinstance(s.get("properties"), dict):
                s.setdefault("required", list(s["properties"]))
        return s
    return _each_schema(schema, close)


# A JSON number a schema leaves unbounded gets these bounds, so that its digits end (a small model
# will otherwise write "31.21888..." to max_tokens, bounds or not: llguidance has no digit limit):
# magnitude at most NUMBER_LIMIT (integers exact in a float64 up to 2^53, about 9e15) and, for
# "number", a multiple of NUMBER_STEP (six decimals). A schema's own minimum / maximum /
# exclusiveMinimum / exclusiveMaximum / multipleOf stand.
NUMBER_LIMIT = 10**15
NUMBER_STEP = 1e-6


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every number and integer schema bounded (NUMBER_LIMIT, NUMBER_STEP) where it
    does not bound itself. A new schema."""
    def bound(s: dict[str, Any]) -> dict[str, Any]:
        number, integer = _has_type(s, "number"), _has_type(s, "integer")
        if not (number or integer):
            return s
        limit: float = NUMBER_LIMIT if integer and not number else float(NUMBER_LIMIT)
        if "minimum" not in s and "exclusiveMinimum" not in s:
            s["minimum"] = -limit
        if "maximum" not in s and "exclusiveMaximum" not in s:
            s["maximum"] = limit
        if number and "multipleOf" not in s:
            s["multipleOf"] = NUMBER_STEP
        return s
    return _each_schema(schema, bound)


# An object schema that lists its properties and says nothing of others (no additionalProperties,
# patternProperties or unevaluatedProperties) is closed: the keys it lists, no others. JSON Schema
# would leave it open, and a small model then adds keys of its own until max_tokens (pydantic's
# model_json_schema(), what instructor and LangChain send, never says additionalProperties). vLLM's
# default grammar engine does the same (xgrammar's strict mode); llguidance has no option for it.
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
               "allOf", "anyOf", "oneOf", "$ref")     # the last four: keys may come from elsewhere


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that lists "properties" and says nothing of other keys
    closed (additionalProperties false). Left open: one that takes keys from elsewhere too (allOf,
    anyOf, oneOf, $ref beside its properties) and the parts of an allOf (each lists only its share
    of the keys: closed, they would exclude each other). A new schema."""
    closed: set[int] = set()

    def close(s: dict[str, Any]) -> dict[str, Any]:
        for part in s.get("allOf") or ():
            if isinstance(part, dict) and id(part) in closed:
                del part["additionalProperties"]
        if isinstance(s.get("properties"), dict) and not any(k in s for k in _OTHER_KEYS):
            s["additionalProperties"] = False
            closed.add(id(s))
        return s
    return _each_schema(schema, close)


def enforced_schema(schema: Any) -> Any:
    """What forge's JSON grammars enforce of a schema: its numbers bounded (bounded_numbers), its
    listed objects closed (closed_objects)."""
    return closed_objects(bounded_numbers(schema))


def json_object_grammar() -> str:
    """Any JSON object."""
    return json_schema_grammar({"type": "object"}, param="response_format")


def regex_grammar(pattern: str, *, param: str) -> str:
    _check_size(pattern, param)
    return str(llguidance.LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: Sequence[str], *, param: str) -> str:
    """Exactly one of `choices` (strings, at least one)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest("choice must be a non-empty list of non-empty strings", param=param)
    return lark_grammar("start: " + " | ".join(json.dumps(c) for c in choices), param=param)


def lark_grammar(text: str, *, param: str) -> str:
    """A context-free grammar in Lark syntax or llama.cpp's GBNF (llguidance converts the latter), refused if
    it nests deeper than MAX_GRAMMAR_DEPTH."""
    _check_size(text, param)
    try:
        lark = str(llguidance.grammar_from("grammar", text))
    except ValueError as exc:
        raise InvalidRequest(f"invalid grammar: {exc}", param=param) from None
    check_grammar(lark, param=param)
    return lark


def _check_size(text: str, param: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"the constraint is too large ({len(text)} characters; at most "
                             f"{MAX_CONSTRAINT_CHARS})", param=param)


# ---- engine side: grammars over one vocabulary -----------------------------------------------------------

class _Vocabulary:
    """forge's Tokenizer as llguidance's TokenizerWrapper expects it: raw bytes per id, special ids, encode."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(tok.special_ids)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode_exact(text)


class Grammars:
    """llguidance over one model's vocabulary: checks grammar texts and makes matchers, each compiled
    grammar cached by its text. Safe to call from several threads (compiling runs outside the lock); a
    matcher belongs to one sequence.
    """

    def __init__(self, tokenizer: Tokenizer, *, num_threads: int = 1, _like: Grammars | None = None) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        self._tokenizer, self._num_threads = tokenizer, num_threads
        if _like is None:
            vocab = _Vocabulary(tokenizer)
            self._lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab))
            self.closing = Closing(vocab.tokens, sorted(tokenizer.end_token_ids))
            self.vocabulary = vocab.tokens      # each id's bytes (forge.sampling.reasoning follows tags over them)
        else:
            self._lltok, self.closing, self.vocabulary = _like._lltok, _like.closing, _like.vocabulary
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._errors: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def sibling(self) -> Grammars:
        """Another grammar engine over the same vocabulary, with its own cache, lock and executor (the
        gateway's, beside the worker's). It shares only what never changes once built: llguidance's
        tokenizer (its token trie, about a second to build for a 262,144-piece vocabulary) and the
        vocabulary's bytes."""
        return Grammars(self._tokenizer, num_threads=self._num_threads, _like=self)

    def check(self, grammar: str, *, param: str | None = None) -> None:
        """Raise InvalidRequest with llguidance's reason if `grammar` does not compile for this vocabulary.
        May take long for a huge grammar (the GIL released): call it off the event loop."""
        self._compile(grammar, param)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start (a copy of the cached compiled one)."""
        return self._compile(grammar, None).deep_copy()

    def _compile(self, grammar: str, param: str | None) -> llguidance.LLMatcher:
        with self._lock:
            pristine, error = self._compiled.get(grammar), self._errors.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
        if pristine is None and error is None:
            matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0)
            with self._lock:
                if matcher.is_error():
                    error = self._remember(self._errors, grammar, matcher.get_error().strip())
                else:
                    pristine = self._remember(self._compiled, grammar, matcher)
        if pristine is None:
            raise InvalidRequest(f"the constraint cannot be compiled: {error}", param=param)
        return pristine

    def fill_masks(self, matchers: Sequence[llguidance.LLMatcher],
                   drafts: Sequence[Sequence[int]] = ()) -> I32:
        """Bitmasks of the tokens each matcher allows next, [rows, ceil(V / 32)]: one row per matcher, or
        with drafts (speculative decoding), 1 + len(drafts[i]) rows for matcher i: what it allows now,
        then after each of its drafts in turn (rows after a draft the grammar refuses allow everything:
        that draft can never be kept, so they are never used). Matchers end as they began. Releases the GIL."""
        if not drafts or not any(drafts):
            masks = llnp.allocate_token_bitmask(len(matchers), self.vocab_size)
            if matchers:
                llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
            return masks
        masks = llnp.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), self.vocab_size)
        plain, drafted, row = [], [], 0
        for m, d in zip(matchers, drafts, strict=True):
            if d:
                drafted.append((m, row, list(d)))
            else:
                plain.append((m, row))
            row += len(d) + 1
        if plain:
            llnp.fill_next_token_bitmask_par(self._executor, plain, masks)
        llnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, masks)
        return masks

    @staticmethod
    def _remember(cache: OrderedDict[str, _V], key: str, value: _V) -> _V:
        cache[key] = value
        if len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
        return value


class Closing:
    """The tokens that close something in JSON, by where the output stands: outside a string, those made of
    ']' and '}' (and whitespace after the first); in a string, its closing '"' and any of those after it
    (not '", "', which ends an item only to start the next); both times the end tokens. `advance` follows
    whether a sequence's output is in a string, byte by byte."""

    def __init__(self, tokens: Sequence[bytes], end_ids: Sequence[int]) -> None:
        self.tokens = tokens
        self.in_string = np.zeros(len(tokens), np.bool_)
        self.outside = np.zeros(len(tokens), np.bool_)
        for i, t in enumerate(tokens):
            self.in_string[i] = t[:1] == b'"' and _closes(t[1:])
            self.outside[i] = t[:1] in (b"]", b"}") and _closes(t)
        ends = [i for i in end_ids if 0 <= i < len(tokens)]
        self.in_string[ends] = True
        self.outside[ends] = True

    def advance(self, state: tuple[bool, bool], token_id: int) -> tuple[bool, bool]:
        """(in a string, after a backslash) once `token_id`'s bytes follow."""
        in_string, escaped = state
        if 0 <= token_id < len(self.tokens):
            for byte in self.tokens[token_id]:
                if escaped:
                    escaped = False
                elif in_string and byte == 0x5C:           # backslash
                    escaped = True
                elif byte == 0x22:                         # '"'
                    in_string = not in_string
        return in_string, escaped

    def mask(self, state: tuple[bool, bool]) -> BoolArray:
        return self.in_string if state[0] else self.outside


def _closes(t: bytes) -> bool:
    return _CLOSERS.issuperset(t)


def allowed_tokens(bitmask: I32, width: int) -> BoolArray:
    """One bitmask row [ceil(V / 32)] as booleans over `width` logits (ids past the vocabulary: False)."""
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")                # [32 * ceil(V / 32)]
    if bits.size >= width:
        return bits[:width].view(np.bool_)
    out = np.zeros(width, np.bool_)
    out[: bits.size] = bits.view(np.bool_)
    return out
