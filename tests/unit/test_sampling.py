from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from forge.errors import EngineError, InvalidRequest
from forge.sampling.penalties import TokenHistory, apply_penalties
from forge.sampling.sampler import SampleOutput, Sampler, SamplingBatch, TokenLogprobs
from forge.sampling.sampling_params import SamplingParams, make_generator

EOS = 2


def make_batch(
    params: Sequence[SamplingParams],
    *,
    generators: Sequence[np.random.Generator] | None = None,
    counts: Sequence[TokenHistory | None] | None = None,
    num_output_tokens: Sequence[int] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=list(params),
        generators=list(generators) if generators is not None else [make_generator(p.seed) for p in params],
        counts=list(counts) if counts is not None else [TokenHistory() if p.has_penalties else None for p in params],
        num_output_tokens=list(num_output_tokens) if num_output_tokens is not None else [0] * n,
    )


def random_logits(seed: int, num_rows: int, vocab_size: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((num_rows, vocab_size)) * scale).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


def reference_probs(raw: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Brute force: full sort, vLLM's order (top-k, top-p on the top-k renormalised, min-p)."""
    z = raw.astype(np.float32) / np.float32(p.temperature)
    w = np.exp(z - z.max()).astype(np.float64)
    vocab_size = w.size
    keep = np.ones(vocab_size, bool)
    if 0 < p.top_k < vocab_size:
        keep &= w >= np.sort(w)[::-1][p.top_k - 1]
    if p.top_p < 1.0:
        kept = np.where(keep, w, 0.0)
        ordered = np.sort(kept)[::-1]
        cumulative = np.cumsum(ordered) / kept.sum()
        num_keep = int(np.searchsorted(cumulative, p.top_p)) + 1       # smallest prefix reaching top_p
        keep &= w >= ordered[min(num_keep, vocab_size) - 1]
    if p.min_p > 0.0:
        keep &= w >= p.min_p
    out = np.where(keep, w, 0.0)
    return out / out.sum()


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: alpha 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def draw_many(logits_row: np.ndarray, params: SamplingParams, num_draws: int, seed: int) -> np.ndarray:
    """num_draws tokens from one row, drawn as a tall batch of copies sharing one generator."""
    sampler, gen = Sampler(eos_token_id=None), make_generator(seed)
    rows = 2000
    logits = np.repeat(logits_row[None, :], rows, axis=0)
    tokens = [sampler.sample(logits, make_batch([params] * rows, generators=[gen] * rows)).token_ids
              for _ in range(num_draws // rows)]
    return np.concatenate(tokens)


# ---- greedy and filters ----------------------------------------------------------------------

def test_greedy_is_argmax_with_ties_to_lower_id() -> None:
    logits = random_logits(0, 4, 50)
    logits[1, [7, 3, 40]] = 100.0                                      # a three-way tie
    out = Sampler(eos_token_id=EOS).sample(logits, make_batch([SamplingParams(temperature=0.0)] * 4))
    assert isinstance(out, SampleOutput)
    assert out.token_ids.dtype == np.int64
    assert out.token_ids.tolist() == [int(np.argmax(r)) for r in logits]
    assert out.token_ids[1] == 3
    assert out.logprobs == [None] * 4


def test_top_k_1_equals_greedy_at_any_temperature() -> None:
    logits = random_logits(1, 8, 1000, scale=0.5)                      # flat: temperature would matter
    greedy = logits.argmax(axis=1)
    for temperature in (0.05, 0.7, 1.0, 2.0):
        params = [SamplingParams(temperature=temperature, top_k=1, seed=s) for s in range(8)]
        assert all(p.is_greedy for p in params)
        out = Sampler().sample(logits, make_batch(params))
        np.testing.assert_array_equal(out.token_ids, greedy)


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(2, 6, 300, scale=0.3)
    params = [SamplingParams(temperature=2.0, top_p=1e-6, seed=s) for s in range(6)]
    sampler = Sampler()
    probs = sampler.probabilities(logits, make_batch(params))
    np.testing.assert_array_equal(probs.argmax(axis=1), logits.argmax(axis=1))
    np.testing.assert_array_equal(probs.max(axis=1), 1.0)
    batch = make_batch(params)
    for _ in range(20):
        np.testing.assert_array_equal(sampler.sample(logits, batch).token_ids, logits.argmax(axis=1))


def test_min_p_filters() -> None:
    logits = random_logits(3, 1, 200, scale=1.0)[0]
    params = SamplingParams(temperature=1.0, min_p=0.1)
    probs = Sampler().probabilities(logits[None, :], make_batch([params]))[0]
    full = softmax(logits)
    keep = full >= 0.1 * full.max()
    assert 1 < keep.sum() < 200
    np.testing.assert_array_equal(probs > 0, keep)
    np.testing.assert_allclose(probs[keep], full[keep] / full[keep].sum(), rtol=1e-5)
    tokens = draw_many(logits, params, 4000, seed=3)
    assert keep[tokens].all()


@pytest.mark.parametrize("vocab_size", [300, 1000, 8000])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_filters_match_a_brute_force_reference(vocab_size: int, scale: float) -> None:
    combos = [
        dict(top_k=5), dict(top_k=50), dict(top_k=3000), dict(top_p=0.5), dict(top_p=0.9), dict(top_p=0.99),
        dict(min_p=0.05), dict(min_p=0.001), dict(top_k=40, top_p=0.8), dict(top_p=0.9, min_p=0.1),
        dict(top_k=100, top_p=0.95, min_p=0.01), dict(top_k=vocab_size + 5), dict(top_k=-1, top_p=0.7),
        dict(top_p=1.0 - 1e-4), dict(min_p=1.0),
    ]
    params = [SamplingParams(temperature=t, **c) for c in combos for t in (0.6, 1.3)]
    logits = random_logits(vocab_size, len(params), vocab_size, scale)
    probs = Sampler().probabilities(logits, make_batch(params))
    for row, p, got in zip(logits, params, probs, strict=True):
        want = reference_probs(row, p)
        np.testing.assert_array_equal(got > 0, want > 0, err_msg=str(p))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-9, err_msg=str(p))


def test_probabilities_of_a_mixed_batch() -> None:
    logits = random_logits(6, 3, 100, scale=1.0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=2, seed=1)]
    probs = Sampler().probabilities(logits, make_batch(params))
    assert probs[0].tolist() == np.eye(100)[logits[0].argmax()].tolist()
    np.testing.assert_allclose(probs[1], softmax(logits[1]), rtol=1e-5)
    assert np.count_nonzero(probs[2]) == 2
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)


# ---- the draw ----------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab_size", [37, 1000, 49152])
def test_seeded_row_draws_the_same_alone_or_in_any_batch(vocab_size: int) -> None:
    mine = [SamplingParams(temperature=0.8, seed=1234), SamplingParams(temperature=1.1, top_p=0.9, seed=-5)]
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3, seed=9),
              SamplingParams(temperature=1.5, presence_penalty=1.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.5, min_p=0.2, logprobs=3), SamplingParams()]
    steps = [random_logits(100 + s, 1, vocab_size, scale=1.0)[0] for s in range(12)]
    for p in mine:
        alone = _run_steps(steps, p, [], position=0)
        for position in (0, 2, 5):
            assert _run_steps(steps, p, others, position=position) == alone
        assert len(set(alone)) > 1                                   # it really samples


def _run_steps(steps: list[np.ndarray], mine: SamplingParams, others: list[SamplingParams], position: int) -> list[int]:
    params = others[:position] + [mine] + others[position:]
    gens = [make_generator(p.seed) for p in params]
    counts = [TokenHistory([1, 2, 3]) if p.has_penalties else None for p in params]
    sampler, tokens = Sampler(eos_token_id=EOS), []
    for s, row in enumerate(steps):
        logits = np.stack([row if i == position else random_logits(s * 7 + i, 1, row.size)[0]
                           for i in range(len(params))])
        out = sampler.sample(logits, make_batch(params, generators=gens, counts=counts,
                                                num_output_tokens=[s] * len(params)))
        for i, c in enumerate(counts):
            if c is not None:
                c.add(int(out.token_ids[i]))
        tokens.append(int(out.token_ids[position]))
    return tokens


class FixedUniform:
    """Stands in for a generator: always the same uniform."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize(("u", "want"), [(0.0, 5), (np.nextafter(1.0, 0.0), 590), (1.0, 590)])
def test_the_draw_never_lands_on_a_dropped_token(u: float, want: int) -> None:
    logits = np.full((1, 600), -1.0, np.float32)                       # 600: a padded last block
    logits[0, [5, 300, 590]] = 5.0
    for params in (SamplingParams(top_k=3), SamplingParams(min_p=0.5), SamplingParams(top_p=0.99, temperature=0.1)):
        batch = make_batch([params], generators=[FixedUniform(u)])  # type: ignore[list-item]
        assert Sampler().sample(logits, batch).token_ids.tolist() == [want], params


def test_unseeded_rows_vary() -> None:
    logits = random_logits(4, 1, 500, scale=0.5)
    runs = []
    for _ in range(2):
        batch = make_batch([SamplingParams(temperature=1.0)])
        runs.append([int(Sampler().sample(logits, batch).token_ids[0]) for _ in range(20)])
    assert runs[0] != runs[1]


def test_make_generator_accepts_any_int64_seed() -> None:
    for seed in (0, 1, -1, 2**63 - 1, -(2**63)):
        assert make_generator(seed).random() == make_generator(seed).random()
    assert make_generator(-1).random() != make_generator(1).random()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.85),
    SamplingParams(temperature=1.4, min_p=0.03),
])
def test_empirical_distribution_matches_the_distribution(params: SamplingParams) -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5, 0.2, -3.0], np.float32)
    want = Sampler().probabilities(logits[None, :], make_batch([params]))[0].astype(np.float64)
    if params == SamplingParams(temperature=1.0):
        np.testing.assert_allclose(want, softmax(logits), rtol=1e-6)
    num_draws = 20000
    seen = np.bincount(draw_many(logits, params, num_draws, seed=77), minlength=logits.size)
    assert (seen[want == 0] == 0).all()
    cells = want > 0
    expected = want[cells] * num_draws
    chi2 = float(((seen[cells] - expected) ** 2 / expected).sum())
    assert chi2 < chi_square_critical(int(cells.sum()) - 1), (chi2, seen, expected)


# ---- penalties and min_tokens ------------------------------------------------------------------

def test_token_counts_grow_incrementally() -> None:
    counts = TokenHistory([5, 3, 5, 9])
    assert counts.seen_ids.tolist() == [3, 5, 9]
    assert counts.output_ids.tolist() == [] and counts.output_counts.tolist() == []
    for t in [9, 4, 9, 9, 4, 100]:
        counts.add(t)
    assert sorted(counts.seen_ids.tolist()) == [3, 4, 5, 9, 100]
    assert counts.output_ids.tolist() == [9, 4, 100]
    assert counts.output_counts.tolist() == [3.0, 2.0, 1.0]
    for t in range(1000, 1100):                                        # past the first buffers
        counts.add(t)
        counts.add(t)
    assert counts.output_ids.size == 103 and counts.seen_ids.size == 105
    assert (counts.output_counts[3:] == 2.0).all()


def test_penalties_change_logits_exactly_as_specified() -> None:
    row = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 4.0], np.float32)
    counts = TokenHistory([0, 1])                                        # prompt
    for t in [1, 3, 3]:                                                 # output
        counts.add(t)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(row, params, counts)
    # 0: prompt only, positive: 2/2.   1: prompt+output once, negative: -1*2 - (0.5*1 + 0.25).
    # 3: output twice, positive: 3/2 - (0.5*2 + 0.25).   2, 4, 5: never seen.
    assert row.tolist() == [1.0, -2.75, 0.5, 0.25, -2.0, 4.0]


def test_penalties_one_at_a_time() -> None:
    base = np.array([1.0, -1.0, 2.0, -2.0], np.float32)
    counts = TokenHistory([0])
    for t in [1, 2, 2]:
        counts.add(t)
    cases = {
        SamplingParams(repetition_penalty=0.5): [2.0, -0.5, 4.0, -2.0],
        SamplingParams(frequency_penalty=-1.0): [1.0, 0.0, 4.0, -2.0],
        SamplingParams(presence_penalty=1.5): [1.0, -2.5, 0.5, -2.0],  # prompt token 0 untouched
    }
    for params, want in cases.items():
        row = base.copy()
        apply_penalties(row, params, counts)
        assert row.tolist() == want, params


def test_penalties_steer_the_sampler_and_leave_logits_alone() -> None:
    logits = np.array([[0.0, 5.0, 4.5, 1.0]], np.float32)
    before = logits.copy()
    counts = TokenHistory([])
    counts.add(1)
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    out = Sampler().sample(logits, make_batch([params], counts=[counts]))
    assert out.token_ids.tolist() == [2]
    np.testing.assert_array_equal(logits, before)
    with pytest.raises(EngineError):
        Sampler().sample(logits, make_batch([params], counts=[None]))


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = np.array([[0.0, 1.0, 9.0, 8.0, 7.0, 3.0]], np.float32)   # eos (2) is the argmax, then 3
    sampler = Sampler(eos_token_id=EOS)
    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,))
    picks = [int(sampler.sample(logits, make_batch([greedy], num_output_tokens=[n])).token_ids[0]) for n in range(5)]
    assert picks == [4, 4, 4, 2, 2]
    sampled = SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=(3, 5))
    probs = sampler.probabilities(logits, make_batch([sampled], num_output_tokens=[1]))[0]
    assert probs[[2, 3, 5]].tolist() == [0.0, 0.0, 0.0] and probs.sum() == pytest.approx(1.0)
    probs = sampler.probabilities(logits, make_batch([sampled], num_output_tokens=[2]))[0]
    np.testing.assert_allclose(probs, softmax(logits[0]), rtol=1e-5)
    batch = make_batch([sampled] * 50, generators=[make_generator(1)] * 50, num_output_tokens=[0] * 50)
    assert not np.isin(sampler.sample(np.repeat(logits, 50, axis=0), batch).token_ids, [2, 3, 5]).any()


# ---- logprobs ----------------------------------------------------------------------------------

def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(5, 3, 400)
    logits[0, [10, 20, 30]] = logits[0].max() + 1.0                    # ties at the top: lower id first
    counts = TokenHistory([10, 11])
    params = [SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0.7, top_k=10, logprobs=20, seed=1),
              SamplingParams(temperature=1.0, logprobs=0, seed=2)]
    out = Sampler().sample(logits, make_batch(params, counts=[counts, None, None]))
    for row, p, token, lp in zip(logits, params, out.token_ids, out.logprobs, strict=True):
        assert isinstance(lp, TokenLogprobs)
        log_softmax = np.log(softmax(row))
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(log_softmax[token], abs=1e-5)
        order = sorted(range(row.size), key=lambda t: (-row[t], t))[: p.logprobs]
        assert [t for t, _ in lp.top] == order
        np.testing.assert_allclose([v for _, v in lp.top], log_softmax[order], atol=1e-5)
    assert [t for t, _ in out.logprobs[0].top][:3] == [10, 20, 30]   # type: ignore[union-attr]
    assert out.logprobs[2].top == ()                                  # type: ignore[union-attr]


def test_logprobs_top_k_with_a_peaked_and_a_flat_row() -> None:
    peaked = np.full(5000, -50.0, np.float32)
    peaked[[4999, 7, 300]] = [10.0, 9.0, 8.0]
    flat = np.zeros(5000, np.float32)
    logits = np.stack([peaked, flat])
    out = Sampler().sample(logits, make_batch([SamplingParams(temperature=0.0, logprobs=5)] * 2))
    assert [t for t, _ in out.logprobs[0].top] == [4999, 7, 300, 0, 1]  # type: ignore[union-attr]
    assert [t for t, _ in out.logprobs[1].top] == [0, 1, 2, 3, 4]       # type: ignore[union-attr]
    assert out.logprobs[1].logprob == pytest.approx(-math.log(5000))    # type: ignore[union-attr]


# ---- params ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "param"), [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=1, pooling="mean"), "prompt_logprobs"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.01), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=2.1), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(stop=("a", "b", "c", "d", "e")), "stop"),
    (dict(stop=("ok", "")), "stop"),
    (dict(stop_token_ids=(5, 1000)), "stop_token_ids"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
])
def test_validate_rejects_each_out_of_range_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs).validate(vocab_size=1000)  # type: ignore[arg-type]
    assert info.value.param == param
    assert param in info.value.message


def test_validate_accepts_the_edges() -> None:
    SamplingParams().validate(vocab_size=10)
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1e-9, top_k=-1, min_p=1.0, presence_penalty=-2.0,
                   frequency_penalty=2.0, repetition_penalty=2.0, min_tokens=1, stop=("a", "b", "c", "d"),
                   stop_token_ids=(0, 9), logprobs=20, seed=-(2**63)).validate(vocab_size=10)
    SamplingParams(temperature=2.0, top_k=0, min_p=0.0, repetition_penalty=1e-3, logprobs=0,
                   seed=2**63 - 1).validate(vocab_size=10)


def test_params_are_frozen_and_round_trip() -> None:
    params = SamplingParams(temperature=0.5, stop=("x",), stop_token_ids=(4,), seed=3, logprobs=2)
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties and not SamplingParams().has_penalties


def test_non_finite_logits_are_an_engine_error() -> None:
    logits = np.zeros((1, 10), np.float32)
    logits[0, 4] = np.nan
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
        with pytest.raises(EngineError):
            Sampler().sample(logits, make_batch([params]))


def test_mismatched_batch_is_an_engine_error() -> None:
    with pytest.raises(EngineError):
        Sampler().sample(np.zeros((2, 10), np.float32), make_batch([SamplingParams()]))
    batch = make_batch([SamplingParams()] * 2, num_output_tokens=[0])
    with pytest.raises(EngineError):
        Sampler().sample(np.zeros((2, 10), np.float32), batch)



def test_min_tokens_bans_every_end_token() -> None:
    """Under min_tokens neither eos nor the model's other end-of-turn tokens may be drawn."""
    logits = random_logits(3, 1, 50)
    logits[0, [EOS, 11, 12]] = [100.0, 99.0, 98.0]                     # eos, then two end-of-turn tokens
    sampler = Sampler(eos_token_id=EOS, end_token_ids=[11, 12])
    params = [SamplingParams(temperature=0.0, min_tokens=2)]
    held = sampler.sample(logits, make_batch(params, num_output_tokens=[1]))
    assert held.token_ids[0] not in (EOS, 11, 12)
    free = sampler.sample(logits, make_batch(params, num_output_tokens=[2]))
    assert free.token_ids[0] == EOS
