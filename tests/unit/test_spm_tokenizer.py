"""SentencePiece BPE vocabularies (tokenizer.ggml.model = 'llama': Llama 2, Mistral, TinyLlama), against
the sentencepiece library itself.

tests/data/spm_tokenizer_reference.json (scripts/reference/make_family_reference.py) holds a 700-piece model
trained by sentencepiece as Llama 2's was (byte fallback, dummy prefix, digits split), stored as such
GGUF files store theirs (<unk>, <s>, </s>, 256 <0xXX> byte pieces, then the pieces with their scores;
no merges), and sentencepiece's ids and decodings for a corpus. transformers' GGUF loader differs
from sentencepiece on texts that start with a space (it adds no dummy prefix there); forge follows
sentencepiece, as llama.cpp does. Gemma's real vocabulary is checked against transformers in
test_gemma3.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from forge.text.detokenizer import IncrementalDetokenizer
from forge.text.tokenizer import Tokenizer
from forge.text.tokenizer_models import spm_merges
from tests import tiny_families

DATA: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parent.parent / "data" / "spm_tokenizer_reference.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tiny_families.write_spm_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", DATA["vocab"])
    return Tokenizer.from_gguf(path)


def test_what_the_file_is(tok: Tokenizer) -> None:
    assert (tok.kind, tok.add_bos, tok.add_space_prefix) == ("spm", True, True)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.vocab_size == len(DATA["vocab"])
    assert tok.missing_bytes == frozenset()
    assert tok.end_token_ids == frozenset({2})


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: repr(c["text"])[:40])
def test_encode_and_decode_match_reference(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["decoded"]


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: repr(c["text"])[:40])
def test_streamed_text_is_the_token_bytes(tok: Tokenizer, case: dict[str, Any]) -> None:
    """Streaming a sequence one id at a time gives its bytes exactly: byte-fallback pieces join into
    whole characters, "▁" is a space (the prefix space included: a continuation's first space is real)."""
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i]) for i in case["ids"]) + detok.flush()
    shown = [i for i in case["ids"] if i not in tok.special_ids]
    assert text == b"".join(tok.token_bytes(i) for i in shown).decode("utf-8", errors="replace")
    assert text.removeprefix(" ") == case["decoded"]         # decode strips that one prefix space


def test_bytes_outside_the_vocabulary_fall_back_to_byte_pieces(tok: Tokenizer) -> None:
    parrot = "\U0001f99c"                                              # a character no piece spells
    assert not any(parrot in v["piece"] for v in DATA["vocab"])
    ids = tok.encode(parrot, add_special_tokens=False)
    pieces = [DATA["vocab"][i]["piece"] for i in ids]
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>"]
    assert b"".join(tok.token_bytes(i) for i in ids).strip() == parrot.encode()


def test_without_a_prefix_space(tmp_path: Path, tok: Tokenizer) -> None:
    """tokenizer.ggml.add_space_prefix = false (as llama.cpp reads it: transformers' GGUF loader ignores
    the flag, so this case has no reference data): no "▁" before the text, none stripped on decode."""
    path = tiny_families.write_spm_tokenizer_gguf(tmp_path / "bare.gguf", DATA["vocab"], add_space_prefix=False)
    bare = Tokenizer.from_gguf(path)
    assert bare.add_space_prefix is False
    ids = bare.encode("The end", add_special_tokens=False)
    assert b"".join(bare.token_bytes(i) for i in ids) == b"The end"
    assert ids != tok.encode("The end", add_special_tokens=False)
    assert bare.decode(bare.encode(" x", add_special_tokens=False)) == " x"


def test_merges_are_ranked_by_the_piece_they_make() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    # "abc" scores highest: its splits come first, the longer left part before the shorter
    merges = spm_merges(tokens, [0.0, 0.0, 0.0, -2.0, -1.0, 5.0])
    assert merges == [("ab", "c"), ("a", "bc"), ("b", "c"), ("a", "b")]


def reference_merges(tokens: list[str], priority: list[float]) -> list[tuple[str, str]]:
    """The ranking written plainly: every split of each piece (its last spelling counting) into two pieces of
    the vocabulary, sorted as tuples by the piece's priority (highest first), the longer left part, the
    longer right part, then the order found."""
    ids = {piece: i for i, piece in enumerate(tokens)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for order, piece in enumerate(tokens):
        if ids[piece] != order:
            continue
        for k in range(1, len(piece)):
            if piece[:k] in ids and piece[k:] in ids:
                found.append((-priority[order], -k, -(len(piece) - k), len(found), piece[:k], piece[k:]))
    return [(left, right) for *_, left, right in sorted(found)]


@pytest.mark.parametrize("seed", range(12))
def test_merges_rank_as_the_plain_sort_does(seed: int) -> None:
    """spm_merges ranks with one numpy sort; ties (equal scores, duplicate spellings) as the tuple sort."""
    rng = random.Random(seed)
    alphabet = "ab▁c"
    tokens = list(alphabet) + ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6))) for _ in range(300)]
    priority = [float(rng.randint(-4, 4)) for _ in tokens]
    assert spm_merges(tokens, priority) == reference_merges(tokens, priority)


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: repr(c["text"])[:40])
def test_exact_encoding_spells_the_text_without_the_prefix(tok: Tokenizer, case: dict[str, Any]) -> None:
    """What the grammar engine tokenizes output fragments with: the text's bytes, nothing added."""
    ids = tok.encode_exact(case["text"])
    assert b"".join(tok.token_bytes(i) for i in ids) == case["text"].encode()


def test_a_grammar_over_a_prefix_space_vocabulary_forces_the_exact_text(tok: Tokenizer) -> None:
    from forge.sampling.structured import Grammars, choice_grammar

    grammars = Grammars(tok)
    matcher = grammars.matcher(choice_grammar(["quick brown"], param="x"))
    ids = tok.encode_exact("quick brown")
    for i in ids:
        assert matcher.consume_token(i), tok.token_str(i)
    assert matcher.is_accepting()
