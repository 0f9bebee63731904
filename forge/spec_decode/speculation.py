"""Speculative decoding's proposing side: n-gram prompt lookup, and how far each sequence looks ahead.

A sequence that is decoding may carry draft tokens into its step: the target model computes them
with its last token in one chunk, the runner samples every position as it would have without
drafts, and the drafts are kept up to the first one that differs (forge.engine.model_runner). With a
deterministic proposer that rule is exactly the rejection rule of Leviathan et al. and Chen et al.
(a draft is kept with probability p(draft); a rejected position's token is drawn from p without the
draft, renormalised), and with each row's own uniform it gives the very tokens plain decoding gives.

The n-gram proposer here needs no model: the tokens after the latest earlier occurrence of the
sequence's last n tokens (n from `max_ngram` down to `min_ngram`), in its prompt or output, are its
guess.
Input-grounded work (rewriting, quoting, extracting) repeats its input, and the guesses land.
The other proposer, a draft model (method "draft"), runs in the model worker (forge.spec_decode.draft_model): the
scheduler budgets its guesses as placeholders that the worker fills in before the step's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPECULATIVE_METHODS = ("off", "ngram", "draft")
NGRAM_WINDOW = 4096                     # a proposal looks this many tokens back at most
# a guess a draft model fills in (forge.spec_decode.draft_model); a forward refuses it
DRAFT_PLACEHOLDER = -1


# Each extra guess costs a row of the step: it pays while few sequences decode (the step is bound by
# reading the weights), less so in a crowd. Measured on input-grounded work, offline (docs/benchmarks.md,
# `scripts/ab/ab_speculative.py lookahead`): 8 guesses beat 4 by 1-5% at 1-4 streams and lose 4-9% at 8-32.
CROWD = 4                                # more sequences decoding than this: a crowd
CROWDED_TOKENS = 4                       # most guesses per sequence in a crowd


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "off"                  # one of SPECULATIVE_METHODS
    num_tokens: int = 8                  # most drafts per sequence per step (CROWDED_TOKENS in a crowd)
    max_ngram: int = 4
    min_ngram: int = 2
    # Speculation pays while a step is bound by reading the weights, not by arithmetic: with more
    # sequences decoding than this, steps carry no drafts (measured: docs/benchmarks.md).
    max_batch: int = 32

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}")
        if not 1 <= self.num_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if self.max_batch < 1:
            raise ValueError("speculative_max_batch must be positive")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def ngram_proposal(tokens: Sequence[int], k: int, *, max_ngram: int = 4, min_ngram: int = 2,
                   window: int = NGRAM_WINDOW) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens`
    (between min_ngram and max_ngram long) within the last `window` tokens; [] when none recurs."""
    n_tokens = len(tokens)
    if k <= 0 or n_tokens <= min_ngram:
        return []
    start = max(0, n_tokens - window)
    seq = np.asarray(tokens[start:], dtype=np.int64)                         # [W]
    size = seq.size
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = seq[size - n:]                                               # [n]
        # Starts i < size - n (earlier than the suffix itself) where seq[i:i+n] == suffix.
        hits = seq[: size - n] == suffix[0]                                   # [W - n]
        for j in range(1, n):
            hits &= seq[j: j + size - n] == suffix[j]
        found = np.flatnonzero(hits)
        if found.size:
            after = int(found[-1]) + n                                        # latest occurrence
            return [int(t) for t in seq[after: after + k]]
    return []


@dataclass(slots=True)
class Lookahead:
    """One sequence's speculation state: whether it proposes, from how its recent drafts fared.

    Acceptance is an exponentially weighted share of drafts kept. A step that carries any draft costs
    most of what it will cost (the kernels leave the one-row path for a small-matrix one), while each
    further draft adds little: so a sequence proposes all it can, or, when its drafts keep failing
    (acceptance under PAUSE_BELOW), nothing for a while before it tries again: PAUSE_STEPS steps,
    and twice the last pause each time the try after a pause fails too (up to MAX_PAUSE_STEPS), so
    that text no guess fits (or a draft model that never agrees) costs almost nothing; a try that
    keeps a guess starts the pauses short again.
    """
    max_tokens: int
    acceptance: float = 0.7
    paused: int = 0
    pause: int = 0                        # the length of the last pause; 0: the last try went well

    DECAY = 0.6
    PAUSE_BELOW = 0.35
    PAUSE_STEPS = 8
    MAX_PAUSE_STEPS = 128

    def budget(self) -> int:
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.max_tokens

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed <= 0:
            return
        self.acceptance = self.DECAY * self.acceptance + (1 - self.DECAY) * (num_accepted / num_proposed)
        if self.acceptance < self.PAUSE_BELOW:
            self.pause = min(2 * self.pause, self.MAX_PAUSE_STEPS) if self.pause else self.PAUSE_STEPS
            self.paused, self.acceptance = self.pause, 0.5
        elif num_accepted:
            self.pause = 0
