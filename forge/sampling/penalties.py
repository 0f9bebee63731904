"""Penalties: a request's token history (TokenHistory) and the repetition/frequency/presence
penalties applied from it to one row of logits.

Pure numpy, in place on the row it is given; it never draws a token and never decides that a sequence stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from forge.sampling.sampling_params import SamplingParams

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


class TokenHistory:
    """A request's distinct prompt+output token ids and output counts. Built once from the prompt;
    the owner add()s each emitted token. Properties are views, valid until the next add()."""

    __slots__ = ("_prompt", "_seen", "_num_seen", "_out_ids", "_out_counts", "_out_index")

    def __init__(self, prompt_ids: Sequence[int] | I64 = ()) -> None:
        self._prompt = np.unique(np.asarray(prompt_ids, dtype=np.int64))      # [P] sorted, distinct
        self._seen = np.zeros(self._prompt.size + 16, np.int64)               # prompt, then new output ids
        self._seen[: self._prompt.size] = self._prompt
        self._num_seen = int(self._prompt.size)
        self._out_ids = np.zeros(16, np.int64)
        self._out_counts = np.zeros(16, np.float32)
        self._out_index: dict[int, int] = {}                                  # token id -> slot

    def add(self, token_id: int) -> None:
        slot = self._out_index.get(token_id)
        if slot is not None:
            self._out_counts[slot] += 1.0
            return
        slot = len(self._out_index)
        self._out_ids, self._out_counts = _room(self._out_ids, slot), _room(self._out_counts, slot)
        self._out_ids[slot], self._out_counts[slot] = token_id, 1.0
        self._out_index[token_id] = slot
        at = int(np.searchsorted(self._prompt, token_id))
        if at == self._prompt.size or self._prompt[at] != token_id:          # not in the prompt either
            self._seen = _room(self._seen, self._num_seen)
            self._seen[self._num_seen] = token_id
            self._num_seen += 1

    @property
    def seen_ids(self) -> I64:
        """Distinct ids in the prompt or the output: [S]."""
        return self._seen[: self._num_seen]

    @property
    def output_ids(self) -> I64:
        """Distinct ids in the output, in order of first appearance: [D]."""
        return self._out_ids[: len(self._out_index)]

    @property
    def output_counts(self) -> F32:
        """How often each of output_ids was emitted: [D]."""
        return self._out_counts[: len(self._out_index)]


def _room(buffer: npt.NDArray[Any], index: int) -> npt.NDArray[Any]:
    """`buffer`, or a copy twice as long when `index` falls past its end."""
    if index < buffer.size:
        return buffer
    grown = np.zeros(2 * buffer.size, buffer.dtype)
    grown[: buffer.size] = buffer
    return grown


def apply_penalties(row: F32, params: SamplingParams, counts: TokenHistory) -> None:
    """Penalise one row of logits [V] in place, touching only tokens the request has seen: repetition
    first (prompt or output; positive logits divided, negative multiplied), then frequency * count +
    presence subtracted (output tokens only)."""
    if params.repetition_penalty != 1.0:
        ids = counts.seen_ids                                                 # [S]
        seen = row[ids]                                                       # [S]
        penalty = np.float32(params.repetition_penalty)
        row[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        ids, num = counts.output_ids, counts.output_counts                    # [D], [D]
        row[ids] -= np.float32(params.frequency_penalty) * num + np.float32(params.presence_penalty)
