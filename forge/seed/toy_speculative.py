"""Greedy speculative decoding for one sequence: a draft model proposes, the target verifies.

With greedy verification every emitted token is the target's own greedy choice, so the output
equals plain greedy decoding with the target token for token; the draft only changes how many
target positions are settled per round. Pure and synchronous; the batched engine path lives elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from forge.seed.toy_model import Model, TokenId


@dataclass(slots=True)
class SpeculationResult:
    """One round: the tokens it emits (at least one), and how many of the drafted were accepted."""

    tokens: list[TokenId]
    accepted: int
    drafted: int

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted, and 0.0 when nothing was drafted (no evidence either way)."""
        return self.accepted / self.drafted if self.drafted else 0.0


class SpeculativeDecoder:
    """Drafts ``lookahead`` greedy tokens with ``draft`` and verifies them with ``target``."""

    def __init__(self, draft: Model, target: Model, lookahead: int) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft and target must share a vocabulary, got {draft.vocab_size} "
                f"and {target.vocab_size}")
        self._draft = draft
        self._target = target
        self._lookahead = lookahead

    @property
    def draft(self) -> Model:
        return self._draft

    @property
    def target(self) -> Model:
        return self._target

    @property
    def lookahead(self) -> int:
        return self._lookahead

    def step(self, context: Sequence[TokenId]) -> SpeculationResult:
        """One round after ``context``: emits 1..lookahead+1 tokens, all the target's greedy choices.

        Does not look at eos; ``generate`` stops there.
        """
        seq = list(context)
        num_context = len(seq)
        for _ in range(self._lookahead):
            seq.append(self._draft.forward(seq).argmax())
        proposals = seq[num_context:]

        # Acceptance rule (greedy): walk the proposals in order; the target's greedy choice at
        # each position is what gets emitted. While it equals the draft's proposal, the proposal
        # is accepted and we go on. At the first mismatch the target's own token replaces the
        # proposal and the round ends (everything drafted after it was conditioned on a wrong
        # token). If all proposals are accepted, the target's next choice is a free bonus token.
        tokens: list[TokenId] = []
        for i, proposal in enumerate(proposals):
            choice = self._target.forward(seq[:num_context + i]).argmax()
            tokens.append(choice)
            if choice != proposal:
                return SpeculationResult(tokens, accepted=i, drafted=self._lookahead)
        tokens.append(self._target.forward(seq).argmax())      # bonus after a full acceptance
        return SpeculationResult(tokens, accepted=self._lookahead, drafted=self._lookahead)

    def generate(self, prompt: Sequence[TokenId], max_new: int) -> tuple[list[TokenId], float]:
        """Up to ``max_new`` tokens after ``prompt``, ending early at (and including) the target's
        eos; plus the aggregate acceptance rate: total accepted / total drafted over all rounds
        run (the last round counts in full even when its tokens are cut), 0.0 if none ran."""
        if max_new < 0:
            raise ValueError(f"max_new must be >= 0, got {max_new}")
        context = list(prompt)
        output: list[TokenId] = []
        num_accepted = num_drafted = 0
        is_finished = False
        while len(output) < max_new and not is_finished:
            result = self.step(context)
            num_accepted += result.accepted
            num_drafted += result.drafted
            for token in result.tokens[:max_new - len(output)]:   # the last round may be cut
                output.append(token)
                context.append(token)
                if token == self._target.eos_token:
                    is_finished = True
                    break
        rate = num_accepted / num_drafted if num_drafted else 0.0
        return output, rate
