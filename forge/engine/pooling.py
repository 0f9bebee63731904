"""Pooling a sequence's final hidden states into one embedding, over the chunks its prompt runs in.

An embedding request is a prompt-only sequence: its prompt may run in several steps (chunked
prefill, or again from the start after a preemption), so a PoolState keeps what it has read so
far and gives the vector at the chunk that ends the prompt. Pure numpy; the runner owns the states.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.messages import SeqChunk

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]


def l2_normalised(vector: npt.NDArray[np.floating]) -> F32:
    """vector / ||vector||, in float64, as float32 (a zero vector stays zero)."""
    v = np.asarray(vector, dtype=np.float64)
    norm = float(np.sqrt(v @ v))
    return (v / norm if norm > 0 else v).astype(np.float32)


def vector_bytes(vector: F32) -> bytes:
    """An embedding on the wire between actors: little-endian float32 (what base64 encodes too)."""
    return np.ascontiguousarray(vector, dtype="<f4").tobytes()


@dataclass(slots=True)
class PoolState:
    """mean: every prompt token's state, averaged; last: the last token's (under causal attention the
    only one that has seen the whole input); cls: the first token's."""
    mode: str
    total: F64 | None = None         # mean: the sum of the rows so far; cls, last: the row itself
    num_rows: int = 0

    def rows(self, chunk: SeqChunk) -> tuple[int, int]:
        """The rows [lo, hi) of this chunk (0: its first token) whose hidden states the pooling reads."""
        n = len(chunk.token_ids)
        if self.mode == "mean":
            return 0, n
        if self.mode == "cls":
            return (0, 1) if chunk.start == 0 else (0, 0)
        return (n - 1, n) if chunk.samples else (n, n)

    def add(self, chunk: SeqChunk, hidden: F32) -> F32 | None:
        """Read the chunk's rows (hidden [hi - lo, H], as rows() said); the L2-normalised vector at
        the chunk that ends the prompt, else None. A chunk from position 0 starts over (preempted)."""
        if chunk.start == 0:
            self.total, self.num_rows = None, 0
        if self.mode == "mean":
            part = hidden.sum(axis=0, dtype=np.float64)                       # [H]
            self.total = part if self.total is None else self.total + part
            self.num_rows += len(hidden)
        elif len(hidden):
            self.total = hidden[-1].astype(np.float64)                        # [H]
        if not chunk.samples:
            return None
        if self.total is None:
            raise ValueError("a pooling sequence ended with no hidden state read")
        vector = self.total / max(self.num_rows, 1) if self.mode == "mean" else self.total
        self.total, self.num_rows = None, 0
        return l2_normalised(vector)
