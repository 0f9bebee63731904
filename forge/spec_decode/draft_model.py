"""Speculative decoding's model proposer: a draft model guesses each drafting sequence's next tokens.

The scheduler decides how many guesses a decoding sequence carries into a step (its chunk ends in
that many DRAFT_PLACEHOLDER tokens); the model runner asks this proposer to fill them in before the
target's forward, which verifies them exactly as it verifies n-gram guesses (forge.engine.model_runner). The draft
proposes greedily (its most likely token), a deterministic proposer: the target's verification then
keeps each guess with probability p(guess) and the output is token for token what plain decoding
gives, seeded sampling included (up to float rounding), whatever else shares the step.

Two kinds of draft:

- A separate model (`--draft-model`): any GGUF with the target's vocabulary. It keeps its own K/V in
  a cache indexed by the target's block tables (same blocks, same slots), so the allocator's books
  cover both. To keep that cache in step it computes every token the target computes, prompt chunks
  included, in the same step; the one position it can miss is the last guess of a run kept whole
  (the target kept it and drew the token after it, the draft never ran it): that position is
  computed first in the sequence's next step.
- The target's first layers (`--draft-layers`): the draft is the target cut after N layers (its
  final norm and head on top), sharing the target's K/V of those layers, which the target's own
  forward keeps current. Pays only for a model trained to exit early; measured on SmolLM2: the
  first 8 of 30 layers agree with the whole model on 2.3% of greedy tokens (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from msgspec.structs import replace

from forge.errors import ConfigError
from forge.messages import SeqChunk
from forge.models.forward_batch import build_forward_batch
from forge.models.llama.kv_cache import KVCache
from forge.models.llama.llama_model import LlamaModel
from forge.spec_decode.speculation import DRAFT_PLACEHOLDER

__all__ = ["DRAFT_PLACEHOLDER", "DraftModel"]


class DraftModel:
    """Fills in a step's placeholder guesses. Used by the model runner's thread only."""

    def __init__(self, model: LlamaModel, kv: KVCache, *, follows_every_chunk: bool, vocab_size: int,
                 p_min: float = 0.0) -> None:
        self.model = model
        self.kv = kv
        # A sequence stops guessing at the first position where the draft's own probability of its
        # guess is under p_min: a guess it is unsure of is likely rejected, and costs a draft pass
        # and a row of the target's step. The step then carries fewer guesses than budgeted.
        self.p_min = p_min
        # A separate draft computes every chunk the target computes; a cut of the target reads the
        # target's K/V and computes only the drafting sequences' rows.
        self.follows_every_chunk = follows_every_chunk
        self.vocab_size = vocab_size            # guesses stay inside the target's vocabulary
        self._missed: dict[int, tuple[int, int]] = {}    # seq id -> (position, token) the draft never ran
        self._unrun: set[int] = set()           # this step's sequences whose last guess the draft never ran

    @classmethod
    def separate(cls, draft: LlamaModel, target: LlamaModel, *, num_blocks: int, block_size: int,
                 dtype: str, p_min: float = 0.0) -> DraftModel:
        return cls(draft, draft.new_kv_cache(num_blocks, block_size, dtype), follows_every_chunk=True,
                   vocab_size=target.config.vocab_size, p_min=p_min)

    @classmethod
    def first_layers(cls, target: LlamaModel, target_kv: KVCache, num_layers: int,
                     p_min: float = 0.0) -> DraftModel:
        total = target.config.num_layers
        if not 1 <= num_layers < total:
            raise ConfigError(f"--draft-layers must be in [1, {total - 1}] for this {total}-layer model")
        config = dataclasses.replace(target.config, num_layers=num_layers)
        weights = dataclasses.replace(target.weights, layers=target.weights.layers[:num_layers])
        return cls(LlamaModel(config, weights), target_kv.first_layers(num_layers), follows_every_chunk=False,
                   vocab_size=target.config.vocab_size, p_min=p_min)

    def forget(self, seq_id: int) -> None:
        self._missed.pop(seq_id, None)

    def missed(self) -> dict[int, tuple[int, int]]:
        """Sequences whose last kept guess the draft has yet to run: (position, token) by sequence id."""
        return dict(self._missed)

    def propose(self, chunks: tuple[SeqChunk, ...]) -> tuple[SeqChunk, ...]:
        """`chunks` with their placeholder guesses filled in (the draft's greedy continuation of the
        chunk's tokens), up to the first the draft is unsure of (p_min): a chunk may come back with
        fewer guesses than placeholders. The draft's K/V of the chunks' tokens computed on the way."""
        drafting = [c for c in chunks if c.num_draft]
        follow = list(chunks) if self.follows_every_chunk else drafting
        if not follow:
            return chunks
        # First forward: each chunk's own tokens (a missed position first), the drafting ones sampled.
        first = []
        for c in follow:
            own = c.token_ids[: len(c.token_ids) - c.num_draft]
            missed = self._missed.pop(c.seq_id, None)
            if missed is not None and missed[0] == c.start - 1:
                first.append(replace(c, token_ids=(missed[1], *own), start=c.start - 1, num_draft=0,
                                     samples=c.num_draft > 0))
            else:
                first.append(replace(c, token_ids=own, num_draft=0, samples=c.num_draft > 0))
        guesses: dict[int, list[int]] = {c.seq_id: [] for c in drafting}
        self._guess(first, guesses)
        # Then one row per sequence per further guess, each at the position after the one before,
        # while the sequence wants more and the draft was sure of its last guess.
        for j in range(1, max((c.num_draft for c in drafting), default=0)):
            rows = [replace(c, token_ids=(guesses[c.seq_id][-1],),
                            start=c.start + len(c.token_ids) - c.num_draft + j - 1, num_draft=0, samples=True)
                    for c in drafting if c.num_draft > j and len(guesses[c.seq_id]) == j]
            if not rows:
                break
            self._guess(rows, guesses)
        # A sequence that stopped early ran its last guess (to learn it was unsure of the next).
        self._unrun = {c.seq_id for c in drafting if len(guesses[c.seq_id]) == c.num_draft}
        return tuple(replace(c, token_ids=(*c.token_ids[: len(c.token_ids) - c.num_draft], *guesses[c.seq_id]),
                             num_draft=len(guesses[c.seq_id]))
                     if c.num_draft else c for c in chunks)

    def kept(self, chunk: SeqChunk, num_kept: int) -> None:
        """The target kept `num_kept` of the chunk's guesses. All of them, and the draft never ran the
        last (it was the last one it was asked for): run its position first next time."""
        if (self.follows_every_chunk and chunk.num_draft and num_kept == chunk.num_draft
                and chunk.seq_id in self._unrun):
            self._missed[chunk.seq_id] = (chunk.start + len(chunk.token_ids) - 1, chunk.token_ids[-1])

    def _guess(self, chunks: list[SeqChunk], guesses: dict[int, list[int]]) -> None:
        """Each sampling chunk's next guess, appended unless the draft gives it less than p_min."""
        batch = build_forward_batch(tuple(chunks), self.kv.block_size)
        logits = self.model.forward(batch, self.kv)[:, : self.vocab_size]       # [R, V]
        picks = logits.argmax(axis=1)                                            # [R]
        if self.p_min > 0:          # the guess's probability: 1 / sum(exp(logits - its logit))
            top = logits[np.arange(len(picks)), picks]                           # [R]
            sure = (1.0 / np.exp(logits - top[:, None]).sum(axis=1) >= self.p_min).tolist()
        else:
            sure = [True] * len(picks)
        for c, token, ok in zip((c for c in chunks if c.samples), picks.tolist(), sure, strict=True):
            if ok:
                guesses[c.seq_id].append(int(token))
