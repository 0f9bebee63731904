"""forge.text.detokenizer with the real default model's tokenizer: whole characters, stop strings."""

from __future__ import annotations

import random

import pytest

from forge.models.hub import pull
from forge.text.detokenizer import IncrementalDetokenizer
from forge.text.tokenizer import Tokenizer

EMOJI_TEXT = "Hi 👋🏽! Family 👩‍👩‍👧‍👦 at 東京 🗼, café ☕, flags 🇳🇴🇧🇷 — done ✅."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(pull(progress=lambda _message: None))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push([i]) for i in ids] + [detok.flush()]


def test_one_by_one_never_splits_a_character(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI_TEXT)
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "" in chunks  # some tokens end inside a character and emit nothing
    assert "".join(chunks) == tok.decode(ids) == EMOJI_TEXT == detok.text


def test_chunked_pushes(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI_TEXT * 3)
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(ids[i : i + 5]) for i in range(0, len(ids), 5)) + detok.flush()
    assert out == EMOJI_TEXT * 3


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("hello<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == "hello"
    kept = "".join(stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "hello<|im_end|>"


def test_unfinished_tail_becomes_replacement_on_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok 👍")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-1]) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok \ufffd" == tok.decode(ids[:-1])


def test_stop_string_split_across_tokens(tok: Tokenizer) -> None:
    text = "The answer is 42.\nEND of story"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["\nEND"])
    chunks = stream(detok, ids)
    assert detok.stopped and detok.stop_reason == "\nEND"
    assert "".join(chunks) == detok.text == "The answer is 42."
    assert all("\n" not in c for c in chunks)  # the held "\n" was never emitted
    assert detok.push(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_string_inside_one_token(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["lo w"])
    out = detok.push(tok.encode("hello world"))
    assert (out, detok.stopped, detok.stop_reason) == ("hel", True, "lo w")


def test_held_prefix_released_when_stop_does_not_complete(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["<END>"])
    assert detok.push(tok.encode("a <E")) == "a "  # "<E" may start "<END>"
    assert detok.push(tok.encode("N")) == ""  # "<EN" still may
    assert detok.push(tok.encode("X!")) == "<ENX!"
    assert not detok.stopped


def test_held_prefix_released_on_flush(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["Observation:"])
    assert detok.push(tok.encode("Thought: Obs")) == "Thought: "
    assert detok.flush() == "Obs"
    assert detok.text == "Thought: Obs" and not detok.stopped


def test_first_completed_stop_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["world", "o w"])
    assert detok.push(tok.encode("hello world")) == "hell"
    assert detok.stop_reason == "o w"
    # "lo w" starts first but "o" completes first; the answer must not depend on chunking.
    for chunk in (1, 100):
        detok = IncrementalDetokenizer(tok, stop=["lo w", "o"])
        ids = tok.encode("hello world")
        out = "".join(detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
        assert (out, detok.stop_reason) == ("hell", "o")


def test_stop_on_special_token_text_when_kept(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=["<|im_end|>"], skip_special_tokens=False)
    assert "".join(stream(detok, tok.encode("bye<|im_end|>junk"))) == "bye"
    assert detok.stop_reason == "<|im_end|>"


def test_stop_after_multibyte_characters(tok: Tokenizer) -> None:
    ids = tok.encode("日本語🗼STOP🗼")
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    chunks = stream(detok, ids)
    assert "".join(chunks) == "日本語🗼" and all("\ufffd" not in c for c in chunks)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("x 👍")
    cut = next(n for n in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:n]))
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:cut])
    assert detok.push(ids[cut:]) + detok.flush() == "👍"
    plain = IncrementalDetokenizer(tok, prompt_ids=tok.encode("x é"))
    assert plain.push(tok.encode("!")) == "!"


def test_random_ids_match_decode(tok: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 20))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        out = "".join(stream(detok, ids))
        assert out == detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_random_stops_match_reference(tok: Tokenizer) -> None:
    rng = random.Random(11)
    alphabet = ["a", "b", "ab", " ", "\n", "é", "🗼", "12", "<|im_end|>", "ba"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 15)))
        stops = ["".join(rng.choice(alphabet[:7]) for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        ids = tok.encode(text)
        decoded = tok.decode(ids)
        hits = [(decoded.find(s) + len(s), decoded.find(s)) for s in stops if s in decoded]
        expected = decoded[: min(hits)[1]] if hits else decoded  # the stop that completes first
        detok = IncrementalDetokenizer(tok, stop=stops)
        chunks = stream(detok, ids)
        assert "".join(chunks) == expected, (text, stops)
        assert detok.stopped == bool(hits)
        assert all("\ufffd" not in c for c in chunks)
        whole = IncrementalDetokenizer(tok, stop=stops)
        assert whole.push(ids) + whole.flush() == expected  # chunking does not change the result
        assert whole.stop_reason == detok.stop_reason
