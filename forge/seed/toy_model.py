"""The one-sequence model protocol, its logits record, and TinyTransformer, a deterministic toy.

TinyTransformer is not a network: its logits are a pure function of the last few tokens, the
vocabulary size and the layer count, hashed with blake2b and expanded by a seeded numpy Generator.
It exists for tests and seed parity; real models live elsewhere. Nothing here does I/O.

How a TinyTransformer forward is built, in order:
  1. base: blake2b-128 of (vocab, layers, last ``NUM_HASHED_TOKENS`` ids as little-endian int64)
     seeds a ``np.random.default_rng``; the logits are ``LOGIT_SCALE * standard_normal(vocab)``.
     Two contexts that share their last 8 tokens get the same logits (an 8-gram model).
  2. eos: one digest byte decides whether the context ends. With probability exactly 1/256 per
     distinct context (byte == 0) eos becomes the strict argmax; otherwise eos is pushed strictly
     below the best other token. So greedy generation emits eos at each step with probability
     ~1/256: about 0.4% of prompts end at once, ~12% within 32 tokens, ~54% within 200.
  3. draft only: on contexts whose digest byte ``% 4 == 0`` (a quarter) the runner-up token is
     lifted above the top one, so the draft's argmax differs there and agrees everywhere else.
  4. pins: ``pin(context, next)`` makes ``next`` the strict argmax after exactly that context.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

TokenId = int
F32 = npt.NDArray[np.float32]

NUM_HASHED_TOKENS = 8     # the logits see only the last 8 tokens of the context
LOGIT_SCALE = 2.0         # standard deviation of a base logit
EOS_ODDS = 256            # eos is the argmax on 1 in EOS_ODDS distinct contexts
_MARGIN = 1.0             # how far a forced argmax is lifted above the rest


@dataclass(frozen=True, slots=True, eq=False)
class StepLogits:
    """Unnormalised scores over the vocabulary for the next token: a 1-D float32 array."""

    logits: F32           # [vocab]

    def __post_init__(self) -> None:
        logits = np.asarray(self.logits, dtype=np.float32)
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        object.__setattr__(self, "logits", logits)

    def argmax(self) -> TokenId:
        """The greedy token; ties go to the lower id (np.argmax returns the first maximum)."""
        return int(np.argmax(self.logits))

    def prob_of(self, token: TokenId) -> float:
        """Softmax probability of ``token``, 0.0 for an id outside ``[0, vocab)``.

        Stable for huge logits (1e30, -1e30, even +-inf): the maximum is subtracted before exp,
        and when some logits are +inf the mass is shared equally among them.
        """
        if not 0 <= token < self.logits.shape[0]:
            return 0.0
        z = self.logits.astype(np.float64)                    # [vocab]
        top = z.max()
        if np.isposinf(top):
            is_top = np.isposinf(z)                           # [vocab]
            return float(is_top[token]) / float(is_top.sum())
        weights = np.exp(z - top)                             # [vocab], max weight is exactly 1
        return float(weights[token] / weights.sum())


@runtime_checkable
class Model(Protocol):
    """A model that scores the next token of one sequence from its whole context."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def eos_token(self) -> TokenId: ...

    def forward(self, context: Sequence[TokenId]) -> StepLogits: ...


class TinyTransformer:
    """Deterministic toy model (see the module docstring for how its logits are made).

    Equal arguments give equal logits in every process: no salted ``hash()`` is involved.
    ``forward`` accepts any int ids (they are only hashed), including an empty context.
    """

    def __init__(self, vocab: int, layers: int) -> None:
        if vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {vocab}")
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self._vocab = vocab
        self._layers = layers
        self._eos: TokenId = 0
        self._is_draft = False
        self._pins: dict[tuple[TokenId, ...], TokenId] = {}

    @classmethod
    def draft(cls, vocab: int, layers: int) -> TinyTransformer:
        """A proposer whose argmax equals ``TinyTransformer(vocab, layers)``'s except on a
        deterministic quarter of contexts (chosen by the context hash), where it differs."""
        model = cls(vocab, layers)
        model._is_draft = True
        return model

    def with_eos(self, eos: TokenId) -> TinyTransformer:
        """A copy of this model (pins included) whose end-of-sequence token is ``eos``."""
        if not 0 <= eos < self._vocab:
            raise ValueError(f"eos must be in [0, {self._vocab}), got {eos}")
        model = TinyTransformer(self._vocab, self._layers)
        model._eos = eos
        model._is_draft = self._is_draft
        model._pins = dict(self._pins)
        return model

    def pin(self, context: Sequence[TokenId], next: TokenId) -> None:  # `next`: the seed's name
        """Make ``next`` the strict argmax after exactly ``context`` (the whole context)."""
        if not 0 <= next < self._vocab:
            raise ValueError(f"pinned token must be in [0, {self._vocab}), got {next}")
        self._pins[tuple(context)] = next

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def num_layers(self) -> int:
        return self._layers

    @property
    def eos_token(self) -> TokenId:
        return self._eos

    def forward(self, context: Sequence[TokenId]) -> StepLogits:
        window = list(context[-NUM_HASHED_TOKENS:])
        digest = hashlib.blake2b(
            struct.pack("<QQ", self._vocab, self._layers)
            + np.asarray(window, dtype="<i8").tobytes(),
            digest_size=16,
        ).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        z = LOGIT_SCALE * rng.standard_normal(self._vocab, dtype=np.float32)   # [vocab]

        best_other = float(np.delete(z, self._eos).max())
        if digest[8] % EOS_ODDS == 0:
            z[self._eos] = best_other + _MARGIN                 # this context ends here
        else:
            z[self._eos] = min(float(z[self._eos]), best_other - _MARGIN)

        if self._is_draft and digest[9] % 4 == 0:
            top, runner_up = np.argsort(-z, kind="stable")[:2]   # ids of the two best logits
            z[runner_up] = z[top] + _MARGIN                     # disagree with the target

        if self._pins and (pinned := self._pins.get(tuple(context))) is not None:
            z[pinned] = z.max() + _MARGIN
        return StepLogits(z)

    def __repr__(self) -> str:
        kind = "draft" if self._is_draft else "target"
        return (f"TinyTransformer(vocab={self._vocab}, layers={self._layers}, "
                f"eos={self._eos}, {kind}, num_pins={len(self._pins)})")
