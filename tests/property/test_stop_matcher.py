"""forge.text.stops against a naive matcher, and the detokenizer's stop strings in linear memory.

The naive matcher is the rule itself: after each character, the stop strings that the text so far
ends with (the first such character ends the output, the longest of them wins), and the text held
back is the longest suffix that is a proper prefix of some stop string. The automaton must agree on
every text and every split of it into pushes. A stop string's cost was once quadratic in its length
(every prefix of it kept in a set): the memory tests would take gigabytes with that.
"""

from __future__ import annotations

import tracemalloc

import hypothesis.strategies as st
from hypothesis import given, settings

from forge.text.detokenizer import IncrementalDetokenizer
from forge.text.stops import StopAutomaton

ALPHABET = "ab\u00e9\U0001f5fc"
texts = st.text(alphabet=ALPHABET, max_size=40)
stop_sets = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4)


def naive_first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(the index just past the first stop string's end, the longest ending there), or None."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def naive_held(text: str, stops: list[str]) -> int:
    prefixes = {s[:n] for s in stops for n in range(1, len(s))}
    return max((n for n in range(1, len(text) + 1) if text[-n:] in prefixes), default=0)


@settings(max_examples=400, deadline=None)
@given(text=texts, stops=stop_sets, cuts=st.lists(st.integers(0, 40), max_size=6))
def test_automaton_agrees_with_the_naive_matcher_however_the_text_is_split(text: str, stops: list[str],
                                                                           cuts: list[int]) -> None:
    auto = StopAutomaton(stops)
    expected = naive_first_stop(text, stops)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    state, found = 0, None
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        state, end, stop = auto.feed(state, text[lo:hi])
        if stop is not None:
            found = (lo + end, stop)
            break
        assert auto.depth[state] == naive_held(text[:hi], stops)
    assert found == expected


class CharTokens:
    """A token source whose ids are Unicode code points: one character a token."""

    special_ids: frozenset[int] = frozenset()

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()


@settings(max_examples=200, deadline=None)
@given(text=texts, stops=stop_sets, cuts=st.lists(st.integers(0, 40), max_size=6))
def test_detokenizer_emits_the_text_before_the_first_stop_and_never_a_stop_prefix(
        text: str, stops: list[str], cuts: list[int]) -> None:
    found = naive_first_stop(text, stops)
    expected = text if found is None else text[: found[0] - len(found[1])]
    ids = [ord(c) for c in text]
    bounds = sorted({0, len(ids), *(c for c in cuts if c <= len(ids))})
    detok = IncrementalDetokenizer(CharTokens(), stop=stops)
    out = ""
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out += detok.push(ids[lo:hi])
        if not detok.stopped:   # what is out so far can never turn out to start a stop string
            assert len(out) == hi - naive_held(text[:hi], stops)
    out += detok.flush()
    assert out == expected
    assert detok.stop_reason == (None if found is None else found[1])


def peak_bytes(fn: object) -> int:
    assert callable(fn)
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_long_stop_string_costs_memory_linear_in_its_length() -> None:
    """A 20,000-character stop string, and text that keeps all but its last character held back: a few
    MB. Every prefix of it in a set was 200 million characters."""
    stop = "x" * 19_999 + "y"

    def run() -> None:
        detok = IncrementalDetokenizer(CharTokens(), stop=[stop, "z" * 20_000])
        for _ in range(19_999):
            assert detok.push([ord("x")]) == ""
        assert detok.push([ord("y")]) == "" and detok.stopped and detok.stop_reason == stop
    assert peak_bytes(run) < 32 * 2**20

