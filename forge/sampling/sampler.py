"""The Sampler: one step's logits [N, V] in, one token per row out.

Owns the draw for a batch of rows: logit_bias and grammar masks, penalties and min_tokens masking
(through forge.sampling.penalties), temperature, top-k/top-p/min-p, the inverse-CDF draw, and logprobs. Pure
numpy; it never decides that a sequence stops.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt

from forge.errors import EngineError
from forge.kernels import det_rowwise
from forge.sampling.penalties import TokenHistory, apply_penalties
from forge.sampling.sampling_params import MAX_LOGIT_BIAS, SamplingParams

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_BLOCK = 256                   # the draw walks block sums first, then one block
_GROUPS = 256                  # strided groups whose maxima give cheap floors under a row's top values
_POOL = 2048                   # top-p sorts at most this many candidates, else buckets them


@dataclass(slots=True)
class SamplingBatch:
    """Per-row inputs for one step, built by the caller; row i goes with logits[i]. counts[i] may be
    None unless params[i].has_penalties; num_output_tokens[i] is what the request emitted so far;
    allowed[i] (when given) is the row's grammar mask over the logits [V], None for an unconstrained row."""

    params: Sequence[SamplingParams]
    generators: Sequence[np.random.Generator]
    counts: Sequence[TokenHistory | None]
    num_output_tokens: Sequence[int]
    allowed: Sequence[BoolArray | None] = field(default=())

    def __len__(self) -> int:
        return len(self.params)


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """The sampled token's logprob and the top alternatives, highest first (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class SampleOutput:
    token_ids: I64                        # [N]
    logprobs: list[TokenLogprobs | None]  # [N], None where the row did not ask


class Sampler:
    """Draws one token per logits row. Holds the eos id and a scratch buffer; one thread at a time."""

    def __init__(self, *, eos_token_id: int | None = None, end_token_ids: Iterable[int] = (),
                 deterministic: bool = False) -> None:
        self.eos_token_id = eos_token_id
        # The deterministic numerics: the weights' exponential and the logprobs' log-sum-exp by fixed float32
        # operations (forge.kernels.det_rowwise), so a seeded draw and its logprobs are the same on every host.
        self.deterministic = deterministic
        # every token that ends a request (eos and the model's other end-of-turn tokens): banned under min_tokens
        self._end_ids = sorted(set(end_token_ids) | ({eos_token_id} if eos_token_id is not None else set()))
        self._scratch: F32 = np.zeros(0, np.float32)

    def sample(self, logits: F32, batch: SamplingBatch) -> SampleOutput:
        """Row i of logits [N, V] gives token_ids[i]. Never writes to logits.

        Each sampled row takes exactly one uniform from its own generator and greedy rows take
        none, so a seeded request draws the same tokens whatever else shares its batch.
        """
        self._check(logits, batch)
        logits = self._biased(logits, batch)
        token_ids = np.zeros(logits.shape[0], np.int64)                       # [N]
        sampled = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        for i, p in enumerate(batch.params):
            if p.is_greedy:
                token_ids[i] = self._argmax(logits, batch, i)
        if sampled:
            weights = self._weights(logits, batch, sampled)                   # [M, Vp]
            blocks = weights.reshape(len(sampled), -1, _BLOCK).sum(axis=2)    # [M, Vp / B]
            for j, i in enumerate(sampled):
                token_ids[i] = _draw(weights[j], blocks[j], float(batch.generators[i].random()))
        logprobs = [None if p.logprobs is None
                    else token_logprobs(logits[i], int(token_ids[i]), p.logprobs, det=self.deterministic)
                    for i, p in enumerate(batch.params)]
        return SampleOutput(token_ids=token_ids, logprobs=logprobs)

    def probabilities(self, logits: F32, batch: SamplingBatch) -> F32:
        """The distributions sample() draws from, [N, V]; greedy rows are one-hot. Draws nothing."""
        self._check(logits, batch)
        logits = self._biased(logits, batch)
        num_rows, vocab_size = logits.shape
        probs = np.zeros((num_rows, vocab_size), np.float32)                  # [N, V]
        sampled = [i for i, p in enumerate(batch.params) if not p.is_greedy]
        for i, p in enumerate(batch.params):
            if p.is_greedy:
                probs[i, self._argmax(logits, batch, i)] = 1.0
        if sampled:
            weights = self._weights(logits, batch, sampled)[:, :vocab_size]   # [M, V]
            probs[sampled] = weights / weights.sum(axis=1, keepdims=True, dtype=np.float64)
        return probs

    def _check(self, logits: F32, batch: SamplingBatch) -> None:
        if logits.ndim != 2 or logits.shape[0] != len(batch):
            raise EngineError(f"logits {logits.shape} do not match a batch of {len(batch)} rows")
        if not len(batch.generators) == len(batch.counts) == len(batch.num_output_tokens) == len(batch):
            raise EngineError("sampling batch columns differ in length")
        if batch.allowed and len(batch.allowed) != len(batch):
            raise EngineError("sampling batch columns differ in length")
        for p, counts in zip(batch.params, batch.counts, strict=True):
            if p.has_penalties and counts is None:
                raise EngineError("a row with penalties needs its TokenHistory")

    def _biased(self, logits: F32, batch: SamplingBatch) -> F32:
        """The logits every later stage reads, logprobs included: logit_bias added (-100 bans a token) and
        grammar masks applied (disallowed tokens -inf). `logits` itself when no row has either; else a copy."""
        rows = [i for i, p in enumerate(batch.params)
                if p.logit_bias or (batch.allowed and batch.allowed[i] is not None)]
        if not rows:
            return logits
        out = logits.copy()                                                   # [N, V]
        for i in rows:
            row = out[i]                                                      # [V] a view into the copy
            add_logit_bias(row, batch.params[i].logit_bias)
            allowed = batch.allowed[i] if batch.allowed else None
            if allowed is not None:
                row[~allowed] = -np.inf
        return out

    def _needs_adjust(self, batch: SamplingBatch, i: int) -> bool:
        p = batch.params[i]
        return p.has_penalties or self._holds_end(p, batch.num_output_tokens[i])

    @staticmethod
    def _holds_end(p: SamplingParams, num_output_tokens: int) -> bool:
        """min_tokens bans the end tokens, except under a grammar: a finished grammar allows only the end."""
        return num_output_tokens < p.min_tokens and p.grammar is None

    def _adjust(self, row: F32, batch: SamplingBatch, i: int) -> None:
        """Penalties, then min_tokens masking (eos and stop_token_ids to -inf), in place on [V]."""
        p, counts = batch.params[i], batch.counts[i]
        if p.has_penalties and counts is not None:
            apply_penalties(row, p, counts)
        if self._holds_end(p, batch.num_output_tokens[i]):
            row[self._end_ids] = -np.inf
            row[list(p.stop_token_ids)] = -np.inf

    def _argmax(self, logits: F32, batch: SamplingBatch, i: int) -> int:
        row = logits[i]                                                       # [V]
        if self._needs_adjust(batch, i):
            row = row.astype(np.float32)                                      # a copy: never write logits
            self._adjust(row, batch, i)
        token = int(row.argmax())                                             # first maximum: lower id wins ties
        if not np.isfinite(row[token]):
            raise EngineError("the model returned non-finite logits")
        return token

    def _weights(self, logits: F32, batch: SamplingBatch, rows: list[int]) -> F32:
        """Weights exp((adjusted logits - max) / T) of `rows` after top-k/top-p/min-p: [M, Vp]. Dropped
        tokens and the padding to whole blocks weigh 0; each row's largest is exactly 1. All work is
        elementwise or within a row, so a row's weights never depend on the other rows."""
        vocab_size = logits.shape[1]
        width = -(-vocab_size // _BLOCK) * _BLOCK
        weights = self._buffer(len(rows), width)                              # [M, Vp]
        weights[:, vocab_size:] = -np.inf
        for j, i in enumerate(rows):
            temperature = batch.params[i].temperature
            if self._needs_adjust(batch, i):
                weights[j, :vocab_size] = logits[i]
                self._adjust(weights[j, :vocab_size], batch, i)
                weights[j, :vocab_size] /= temperature
            else:
                np.divide(logits[i], temperature, out=weights[j, :vocab_size])  # copy and scale in one pass
        peak = weights.max(axis=1, keepdims=True)                             # [M, 1]
        if not np.isfinite(peak).all():
            raise EngineError("the model returned non-finite logits")
        np.subtract(weights, peak, out=weights)
        if self.deterministic:
            dead = weights == -np.inf                                         # weigh 0, as exp gives them
            det_rowwise.exp_(weights)                                         # [M, Vp]
            weights[dead] = 0.0
        else:
            np.exp(weights, out=weights)                                      # [M, Vp]
        for j, i in enumerate(rows):
            p = batch.params[i]
            if 0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0:
                row = weights[j, :vocab_size]                                 # [V]
                np.multiply(row, row >= _keep_threshold(row, p), out=row)
        return weights

    def _buffer(self, num_rows: int, width: int) -> F32:
        if self._scratch.size < num_rows * width:
            self._scratch = np.empty(num_rows * width, np.float32)
        return self._scratch[: num_rows * width].reshape(num_rows, width)


def _keep_threshold(weights: F32, params: SamplingParams) -> float:
    """The smallest weight that top-k, then top-p, then min-p keep, for weights [V] whose largest is
    exactly 1. Ties at a cut are all kept: top-k keeps more than k only where weights tie exactly."""
    floor = params.min_p                          # p_i >= min_p * p_max, and p_max has weight 1
    if 0 < params.top_k < weights.size:
        best = _largest(weights, params.top_k)                                # [k] descending
        floor = max(floor, float(best[-1]))
        if params.top_p < 1.0:                    # top-p over the top-k set, renormalised
            floor = max(floor, _cut(best, params.top_p * float(best.sum(dtype=np.float64))))
    elif params.top_p < 1.0:
        floor = max(floor, _top_p_floor(weights, params.top_p * float(weights.sum())))
    return floor


def _cut(best: F32, need: float) -> float:
    """The last of the descending values [C] in the shortest prefix whose sum reaches need."""
    cumulative = np.cumsum(best, dtype=np.float64)                            # [C]
    return float(best[min(int(np.searchsorted(cumulative, need)), best.size - 1)])


def _largest(weights: F32, k: int) -> F32:
    """The k largest weights, descending: [k]."""
    maxima = _group_maxima(weights)                                           # [G] descending
    floor = maxima[k - 1] if k <= maxima.size else np.partition(weights, weights.size - k)[weights.size - k]
    pool = weights[weights >= floor]                                          # [C >= k]
    return np.sort(np.partition(pool, pool.size - k)[pool.size - k:])[::-1]


def _group_maxima(values: F32) -> F32:
    """Maxima of the strided groups (ids equal modulo G), descending: [G] (a short row: itself, sorted).
    They are G distinct entries, so j entries reach the j-th: a cheap floor under the j largest."""
    if values.size < 2 * _GROUPS:
        return np.sort(values)[::-1]
    full = values.size // _GROUPS * _GROUPS
    maxima = values[:full].reshape(-1, _GROUPS).max(axis=0)                   # [G]
    tail = values[full:]                                                      # [< G] joins groups 0..
    np.maximum(maxima[: tail.size], tail, out=maxima[: tail.size])
    return np.sort(maxima)[::-1]


def _top_p_floor(weights: F32, need: float) -> float:
    """The smallest weight in the shortest top set of weights [V] whose sum reaches need."""
    maxima = _group_maxima(weights)                                           # [G] descending
    reach = int(np.searchsorted(np.cumsum(maxima, dtype=np.float64), need))
    if reach < maxima.size:               # the weights from maxima[reach] up hold the need
        above = weights >= maxima[reach]                                      # [V]
        if np.count_nonzero(above) <= _POOL:
            return _cut(np.sort(weights[above])[::-1], need)
    # A flat row: find the bucket (1/8 of an octave) holding the cut, then cut inside it alone.
    keys = weights.view(np.int32) >> 20                                       # [V] rises with the weight
    mass = np.bincount(keys, weights=weights)                                 # [K] per bucket
    from_top = np.cumsum(mass[::-1])[::-1]                                    # [K] mass of buckets >= b
    bucket = int(np.count_nonzero(from_top >= need)) - 1
    if bucket < 0:                        # rounding: nothing reaches the need, so keep every token
        return 0.0
    higher = float(from_top[bucket + 1]) if bucket + 1 < from_top.size else 0.0
    return _cut(np.sort(weights[keys == bucket])[::-1], need - higher)


def _draw(weights: F32, blocks: F32, u: float) -> int:
    """Inverse CDF in id order over weights [Vp], given block sums [Vp / B] and a uniform u in [0, 1):
    the block first, then the token inside it, so no cumsum runs over the whole row."""
    ends = np.cumsum(blocks, dtype=np.float64)                                # [Vp / B]
    target = u * float(ends[-1])
    block = _search(ends, target)
    start = block * _BLOCK
    before = float(ends[block - 1]) if block else 0.0
    inside = before + np.cumsum(weights[start:start + _BLOCK], dtype=np.float64)  # [B]
    return start + _search(inside, target)


def _search(cumulative: F64, target: float) -> int:
    """The first index whose cumulative weight exceeds target: never a zero weight."""
    index = int(np.searchsorted(cumulative, target, side="right"))
    if index == cumulative.size:                                              # rounding reached the total
        index = int(np.searchsorted(cumulative, cumulative[-1], side="left"))
    return index


def add_logit_bias(row: F32, logit_bias: Iterable[tuple[int, float]]) -> None:
    """Each (token id, bias) added to the logits row [V] in place; a bias of -100 bans the token (-inf)."""
    for token_id, bias in logit_bias:
        row[token_id] = -np.inf if bias <= -MAX_LOGIT_BIAS else row[token_id] + np.float32(bias)


def token_logprobs(raw: F32, token_id: int, k: int, det: bool = False) -> TokenLogprobs:
    """Logprobs from the log_softmax of the logits [V] after logit_bias and the grammar mask, before
    penalties and temperature; `det`: the log-sum-exp det_rowwise's (the deterministic numerics)."""
    raw = raw.astype(np.float32, copy=False)
    if det:
        log_total = float(det_rowwise.logsumexp(np.ascontiguousarray(raw)[None, :])[0])
    else:
        peak = float(raw.max())
        log_total = peak + math.log(float(np.exp(raw - peak).sum()))         # pairwise float32 sum
    top = _top_ids(raw, k)                                                    # [k]
    return TokenLogprobs(token_id=token_id, logprob=float(raw[token_id]) - log_total,
                         top=tuple((int(t), float(raw[t]) - log_total) for t in top))


def _top_ids(raw: F32, k: int) -> I64:
    """Ids of the k largest logits, descending, ties to the lower id: [k]."""
    if k == 0:
        return np.zeros(0, np.int64)
    ids = np.flatnonzero(raw >= _group_maxima(raw)[k - 1])                   # [C >= k] ascending
    values = raw[ids]                                                         # [C]
    if ids.size > k:
        keep = values >= np.partition(values, ids.size - k)[ids.size - k]     # the k largest and their ties
        ids, values = ids[keep], values[keep]
    return ids[np.lexsort((ids, -values))[:k]]
