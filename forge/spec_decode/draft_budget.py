"""How much of a step's budget speculation may take, and the guesses it spends it on.

Guesses come last: only from budget no prompt can use this step. A guess may be rejected; a prompt
token is work that must be done, and someone waits for its end. The guesses themselves come from
forge.spec_decode.speculation (n-gram lookup) or, as placeholders, from the model worker's draft model.
"""

from __future__ import annotations

from forge.engine.sequence import Sequence, TokenId
from forge.spec_decode.speculation import (
    CROWD,
    CROWDED_TOKENS,
    DRAFT_PLACEHOLDER,
    NGRAM_WINDOW,
    SpeculativeConfig,
    ngram_proposal,
)


def speculates(spec: SpeculativeConfig, running: list[Sequence]) -> bool:
    """Whether this step's decode rows may carry drafts: speculation is on, and few enough
    sequences decode that a step is bound by reading the weights, not by arithmetic."""
    if not spec.enabled:
        return False
    decoding = sum(1 for s in running if s.total_len() - s.num_computed_tokens == 1)
    return 0 < decoding <= spec.max_batch


def hand_out(spec: SpeculativeConfig, decoding: list[Sequence], spare: int) -> int:
    """Give each decoding sequence its drafts (Sequence.draft) from `spare` tokens of budget, in
    order, fewer each in a crowd; returns the tokens they took."""
    most = CROWDED_TOKENS if len(decoding) > CROWD else None
    taken = 0
    for seq in decoding:
        if spare - taken <= 0:
            break
        seq.draft = propose(spec, seq, spare - taken if most is None else min(spare - taken, most))
        taken += len(seq.draft)
    return taken


def propose(spec: SpeculativeConfig, seq: Sequence, budget: int) -> list[TokenId]:
    """Up to `budget` guesses for the tokens after the sequence's last, within its lookahead and
    its length limit (drafts past the limit are waste)."""
    assert seq.lookahead is not None
    room = min(seq.max_new_tokens - len(seq.output) - 1, budget)
    if room <= 0:
        return []
    k = min(seq.lookahead.budget(), room)
    if k <= 0:
        return []
    if spec.method == "draft":                 # the model runner's draft model fills them in
        return [DRAFT_PLACEHOLDER] * k
    end = seq.total_len()                      # the window only: no copy of a long sequence per step
    return ngram_proposal(seq.tokens(max(0, end - NGRAM_WINDOW), end), k, max_ngram=spec.max_ngram,
                          min_ngram=spec.min_ngram)
