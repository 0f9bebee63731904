"""Prompt logprobs: what the model gives each prompt token after the tokens before it, read off the prefill.

A sequence that asks (SamplingParams.prompt_logprobs) has the final normed hidden states of its prompt
positions kept through the forward (the rows a pooling reads, forge.engine.pooling), and the runner puts
them through the model's head a slice at a time: the row at position p scores the prompt token at p + 1, by
the same log-softmax, top-k and logit_bias as a sampled token's logprobs (forge.sampling.sampler), so a
token scored in a prompt and the same token generated after the same tokens get the same figure. Its
prompt may run over several steps (chunked prefill) or again after a preemption: a PromptScoring keeps how
far it has scored, and scores each position once. Other sequences' rows cost nothing here. Pure numpy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.errors import EngineError
from forge.messages import PromptLogprobs, SampledToken, SeqChunk
from forge.sampling.sampler import add_logit_bias, token_logprobs

F32 = npt.NDArray[np.float32]

# Rows put through the head at once: the logits of a slice are [HEAD_ROWS, V] float32 (a 151k vocabulary's
# are 39 MB), however long the prompt chunk.
HEAD_ROWS = 64


@dataclass(slots=True)
class PromptScoring:
    """One sequence's prompt scoring: its prompt, the alternatives asked per token, its logit_bias (which its
    sampled tokens' logprobs see too), and how many prompt tokens are scored so far (the first has nothing
    before it: it is never scored)."""
    prompt_ids: tuple[int, ...]
    num_top: int
    logit_bias: tuple[tuple[int, float], ...] = ()
    num_scored: int = 1
    deterministic: bool = False        # the deterministic numerics' log-sum-exp (forge.kernels.det_rowwise)

    @property
    def done(self) -> bool:
        return self.num_scored >= len(self.prompt_ids)

    def rows(self, chunk: SeqChunk) -> tuple[int, int]:
        """The rows [lo, hi) of this chunk (0: its first token) whose logits score prompt tokens not scored
        yet: the row at position p scores the token at p + 1, up to the prompt's last. (0, 0) for none."""
        lo = max(chunk.start, self.num_scored - 1)
        hi = min(chunk.start + len(chunk.token_ids), len(self.prompt_ids) - 1)
        if hi <= lo:
            return 0, 0
        if chunk.start > self.num_scored - 1:
            raise EngineError(f"prompt logprobs need every prompt position: position {self.num_scored - 1} "
                              f"was never computed (the chunk starts at {chunk.start})")
        return lo - chunk.start, hi - chunk.start

    def score(self, seq_id: int, hidden: F32, head: Callable[[F32], F32]) -> PromptLogprobs:
        """The next len(hidden) prompt tokens scored from the hidden states [M, H] of the positions before
        them (rows() said which), through `head` (hidden [m, H] -> logits [m, V]) HEAD_ROWS at a time."""
        start = self.num_scored
        targets = self.prompt_ids[start:start + len(hidden)]
        if len(targets) != len(hidden):
            raise EngineError("more prompt positions to score than the prompt has")
        out: list[SampledToken] = []
        for a in range(0, len(hidden), HEAD_ROWS):
            logits = head(hidden[a:a + HEAD_ROWS])                                  # [m, V]
            out.extend(_scored(seq_id, logits, targets[a:a + HEAD_ROWS], self.num_top, self.logit_bias,
                               self.deterministic))
        self.num_scored += len(out)
        return PromptLogprobs(seq_id=seq_id, start=start, tokens=tuple(out))


def _scored(seq_id: int, logits: F32, targets: tuple[int, ...], k: int,
            logit_bias: tuple[tuple[int, float], ...], det: bool = False) -> list[SampledToken]:
    """Each row of logits [m, V] scores its target: the target's logprob, its rank, and the top k."""
    out = []
    for row, target in zip(logits, targets, strict=True):
        if logit_bias:
            row = row.copy()                                                        # [V]
            add_logit_bias(row, logit_bias)
        if not np.isfinite(row.max()):
            raise EngineError("the model returned non-finite logits")
        scored = token_logprobs(row, target, k, det=det)
        out.append(SampledToken(seq_id=seq_id, token_id=target, logprob=scored.logprob, top_logprobs=scored.top,
                                rank=int(np.count_nonzero(row >= row[target]))))
    return out
