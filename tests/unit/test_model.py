from __future__ import annotations

import math
import random

import numpy as np
import pytest

from forge.seed.toy_model import Model, StepLogits, TinyTransformer


def random_contexts(num: int, seed: int, vocab: int = 320) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(0, 24))] for _ in range(num)]


# StepLogits

def test_argmax_breaks_ties_towards_the_lower_id() -> None:
    assert StepLogits(np.array([0.5, 2.0, 1.0, 2.0], dtype=np.float32)).argmax() == 1
    assert StepLogits(np.zeros(7, dtype=np.float32)).argmax() == 0


def test_logits_are_held_as_1d_float32() -> None:
    step = StepLogits(np.array([1, 2, 3]))
    assert step.logits.dtype == np.float32 and step.logits.shape == (3,)
    with pytest.raises(ValueError):
        StepLogits(np.zeros((2, 2), dtype=np.float32))


def test_prob_of_matches_softmax() -> None:
    z = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    expected = np.exp(z) / np.exp(z).sum()
    for token in range(3):
        assert StepLogits(z).prob_of(token) == pytest.approx(float(expected[token]), rel=1e-6)


def test_prob_of_is_stable_for_huge_logits() -> None:
    step = StepLogits(np.array([1e30, -1e30, 0.0, 1e30], dtype=np.float32))
    probs = [step.prob_of(t) for t in range(4)]
    assert all(math.isfinite(p) for p in probs)
    assert probs == pytest.approx([0.5, 0.0, 0.0, 0.5])
    assert StepLogits(np.array([-1e30, -1e30], dtype=np.float32)).prob_of(1) == pytest.approx(0.5)


def test_prob_of_handles_infinite_logits() -> None:
    step = StepLogits(np.array([np.inf, 0.0, -np.inf], dtype=np.float32))
    assert [step.prob_of(t) for t in range(3)] == [1.0, 0.0, 0.0]


def test_prob_of_out_of_range_is_zero() -> None:
    step = StepLogits(np.array([1.0, 2.0], dtype=np.float32))
    assert step.prob_of(-1) == 0.0
    assert step.prob_of(2) == 0.0
    assert step.prob_of(10**9) == 0.0


# TinyTransformer

def test_tiny_transformer_is_a_model() -> None:
    model = TinyTransformer(320, 2)
    assert isinstance(model, Model)
    assert (model.vocab_size, model.num_layers, model.eos_token) == (320, 2, 0)
    logits = model.forward([1, 2, 3]).logits
    assert logits.shape == (320,) and logits.dtype == np.float32


def test_forward_is_deterministic_across_instances() -> None:
    a, b = TinyTransformer(320, 2), TinyTransformer(320, 2)
    for context in random_contexts(50, seed=1) + [[]]:
        np.testing.assert_array_equal(a.forward(context).logits, b.forward(context).logits)


def test_forward_matches_recorded_values() -> None:
    # Recorded once: the logits come from blake2b and a seeded Generator only, so they must not
    # change between processes or runs (a salted hash() would break this).
    model = TinyTransformer(320, 2)
    context, output = [72, 105], []
    for _ in range(8):
        output.append(model.forward(context).argmax())
        context.append(output[-1])
    assert output == [30, 47, 152, 105, 203, 105, 91, 12]
    assert model.forward([]).argmax() == 318


def test_layers_and_vocab_change_the_model() -> None:
    context = [5, 6, 7]
    base = TinyTransformer(320, 2).forward(context).logits
    assert not np.array_equal(base, TinyTransformer(320, 3).forward(context).logits)
    assert TinyTransformer(321, 2).forward(context).logits.shape == (321,)


def test_draft_disagrees_on_about_a_quarter_of_contexts() -> None:
    target, draft = TinyTransformer(320, 2), TinyTransformer.draft(320, 2)
    contexts = random_contexts(2000, seed=2)
    num_differ = sum(draft.forward(c).argmax() != target.forward(c).argmax() for c in contexts)
    assert 0.15 * 2000 <= num_differ <= 0.35 * 2000


def test_draft_disagreement_is_deterministic() -> None:
    contexts = random_contexts(200, seed=3)
    a, b = TinyTransformer.draft(320, 2), TinyTransformer.draft(320, 2)
    assert [a.forward(c).argmax() for c in contexts] == [b.forward(c).argmax() for c in contexts]


def test_pin_forces_the_argmax_after_that_exact_context() -> None:
    model = TinyTransformer(320, 2)
    context = [10, 20, 30]
    unpinned = model.forward(context).argmax()
    choice = (unpinned + 1) % 320
    model.pin(context, choice)
    step = model.forward(context)
    assert step.argmax() == choice
    assert step.prob_of(choice) == max(step.prob_of(t) for t in range(320))
    assert model.forward([99, 10, 20, 30]).argmax() == TinyTransformer(320, 2).forward(
        [99, 10, 20, 30]).argmax()                           # a longer context is not pinned


def test_pin_applies_to_drafts_and_survives_with_eos() -> None:
    draft = TinyTransformer.draft(320, 2)
    draft.pin([1], 7)
    assert draft.forward([1]).argmax() == 7
    assert draft.with_eos(3).forward([1]).argmax() == 7
    with pytest.raises(ValueError):
        draft.pin([1], 320)


def test_pin_to_eos_ends_generation() -> None:
    model = TinyTransformer(320, 2).with_eos(5)
    model.pin([1, 2], 5)
    assert model.forward([1, 2]).argmax() == model.eos_token == 5


def test_with_eos_validates_and_chains() -> None:
    model = TinyTransformer(320, 2).with_eos(0).with_eos(319)
    assert model.eos_token == 319
    assert TinyTransformer.draft(320, 2).with_eos(4).eos_token == 4
    for bad in (320, -1):
        with pytest.raises(ValueError):
            TinyTransformer(320, 2).with_eos(bad)


def test_with_eos_leaves_the_original_alone() -> None:
    base = TinyTransformer(320, 2)
    base.with_eos(9)
    assert base.eos_token == 0


@pytest.mark.parametrize(("vocab", "layers"), [(1, 2), (0, 2), (320, 0), (320, -1)])
def test_bad_shapes_raise(vocab: int, layers: int) -> None:
    with pytest.raises(ValueError):
        TinyTransformer(vocab, layers)
    with pytest.raises(ValueError):
        TinyTransformer.draft(vocab, layers)


def test_eos_is_rare_but_reachable() -> None:
    # The eos rule makes eos the argmax on ~1/256 of contexts: greedy runs from byte prompts
    # should sometimes end within 200 tokens and usually not at the first step.
    model = TinyTransformer(320, 2)
    rng = random.Random(4)
    num_immediate = num_ended = 0
    for _ in range(40):
        context = [rng.randrange(1, 257) for _ in range(rng.randint(1, 12))]
        for step in range(200):
            token = model.forward(context).argmax()
            if token == model.eos_token:
                num_immediate += step == 0
                num_ended += 1
                break
            context.append(token)
    assert num_immediate < 40
    assert 0 < num_ended < 40


def test_eos_is_never_a_tie_winner_by_accident() -> None:
    # eos is either the strict argmax or strictly below the best other token.
    model = TinyTransformer(320, 2)
    for context in random_contexts(300, seed=5):
        z = model.forward(context).logits
        others = np.delete(z, 0).max()
        assert z[0] != others
