from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.seed.byte_tokenizer import VOCAB_SIZE
from forge.seed.toy_model import Model, TinyTransformer
from forge.seed.toy_speculative import SpeculationResult, SpeculativeDecoder

TARGET = TinyTransformer(VOCAB_SIZE, 2)
DRAFT = TinyTransformer.draft(VOCAB_SIZE, 2)


def greedy(model: Model, prompt: list[int], max_new: int, *, stop_at_eos: bool = True) -> list[int]:
    """Plain greedy decoding: the reference speculative decoding must reproduce."""
    context, output = list(prompt), []
    for _ in range(max_new):
        token = model.forward(context).argmax()
        output.append(token)
        context.append(token)
        if stop_at_eos and token == model.eos_token:
            break
    return output


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        SpeculativeDecoder(DRAFT, TARGET, 0)
    with pytest.raises(ValueError):
        SpeculativeDecoder(TinyTransformer.draft(256, 2), TARGET, 4)
    with pytest.raises(ValueError):
        SpeculativeDecoder(DRAFT, TARGET, 4).generate([1], -1)


def test_acceptance_rate() -> None:
    assert SpeculationResult([1, 2], accepted=1, drafted=4).acceptance_rate == 0.25
    assert SpeculationResult([1], accepted=0, drafted=0).acceptance_rate == 0.0


@pytest.mark.parametrize("lookahead", [1, 3, 8])
def test_step_always_emits_the_targets_tokens(lookahead: int) -> None:
    decoder = SpeculativeDecoder(DRAFT, TARGET, lookahead)
    rng = random.Random(lookahead)
    for _ in range(50):
        context = [rng.randrange(1, 257) for _ in range(rng.randint(0, 10))]
        result = decoder.step(context)
        assert result.drafted == lookahead
        assert 0 <= result.accepted <= lookahead
        assert len(result.tokens) == result.accepted + 1
        assert result.tokens == greedy(TARGET, context, len(result.tokens), stop_at_eos=False)


def test_step_rejects_at_the_first_mismatch() -> None:
    draft = TinyTransformer(VOCAB_SIZE, 2)
    context = [5, 6, 7]
    wrong = (TARGET.forward(context).argmax() + 1) % VOCAB_SIZE
    draft.pin(context, wrong)
    result = SpeculativeDecoder(draft, TARGET, 4).step(context)
    assert (result.accepted, result.drafted) == (0, 4)
    assert result.tokens == [TARGET.forward(context).argmax()]


def test_identical_draft_accepts_everything() -> None:
    decoder = SpeculativeDecoder(TARGET, TinyTransformer(VOCAB_SIZE, 2), 4)
    result = decoder.step([1, 2, 3])
    assert (result.accepted, len(result.tokens), result.acceptance_rate) == (4, 5, 1.0)
    tokens, rate = SpeculativeDecoder(TARGET, TARGET, 4).generate([72, 105], 40)
    assert rate == 1.0
    assert tokens == greedy(TARGET, [72, 105], 40)


def test_generate_stops_at_eos_and_includes_it() -> None:
    target = TinyTransformer(VOCAB_SIZE, 2)
    prompt = [10, 11]
    plain = greedy(target, prompt, 5)
    assert target.eos_token not in plain                    # so the pin below is what ends it
    target.pin(prompt + plain[:3], target.eos_token)
    tokens, _ = SpeculativeDecoder(DRAFT, target, 4).generate(prompt, 50)
    assert tokens == plain[:3] + [target.eos_token]


def test_generate_zero_tokens() -> None:
    assert SpeculativeDecoder(DRAFT, TARGET, 2).generate([1, 2], 0) == ([], 0.0)


def test_draft_acceptance_is_partial() -> None:
    _, rate = SpeculativeDecoder(DRAFT, TARGET, 4).generate([104, 105], 64)
    assert 0.0 < rate < 1.0


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(1, 256), min_size=0, max_size=24),
    lookahead=st.integers(1, 8),
    max_new=st.integers(0, 64),
)
def test_generate_equals_plain_greedy(prompt: list[int], lookahead: int, max_new: int) -> None:
    tokens, rate = SpeculativeDecoder(DRAFT, TARGET, lookahead).generate(prompt, max_new)
    assert tokens == greedy(TARGET, prompt, max_new)
    assert 0.0 <= rate <= 1.0
