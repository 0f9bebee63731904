"""The model runner: turns one StepBatch into arrays, runs the forward, samples.

It owns what the model worker holds: the model, the K/V arrays and each running sequence's
sampling state (its random generator, token counts and grammar matcher). It knows nothing about
scheduling. The grammar masks of a step are computed on a helper thread while the forward runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from forge.engine.pooling import PoolState, vector_bytes
from forge.engine.prompt_scoring import PromptScoring
from forge.errors import ConfigError, EngineError
from forge.messages import Embedding, PromptLogprobs, SampledToken, SeqChunk, StepBatch, StepOutput
from forge.models.forward_batch import ForwardBatch, build_forward_batch
from forge.models.llama.kv_cache import KVCache
from forge.models.llama.linear import active_pool
from forge.models.llama.llama_model import LlamaModel
from forge.sampling.penalties import TokenHistory
from forge.sampling.reasoning import Section, SectionFollower
from forge.sampling.sampler import Sampler, SamplingBatch
from forge.sampling.sampling_params import SamplingParams, make_generator
from forge.sampling.structured import Grammars, allowed_tokens
from forge.spec_decode.draft_model import DraftModel

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class BatchedModel(Protocol):
    # kv is the model's own cache, made by new_kv_cache and handed back to forward: opaque to the
    # runner, so Any (a model's forward takes its own cache type, which `object` would not admit).
    def forward(self, batch: ForwardBatch, kv: Any) -> F32: ...
    def forward_hidden(self, batch: ForwardBatch, kv: Any, hidden_rows: I64) -> tuple[F32, F32]: ...
    def head_logits(self, hidden: F32) -> F32: ...
    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: str = "float32") -> Any: ...


@dataclass(slots=True)
class _SeqSampling:
    params: SamplingParams
    generator: np.random.Generator
    counts: TokenHistory | None
    matcher: Any = None                  # an llguidance matcher for a constrained sequence
    json_state: tuple[bool, bool] = (False, False)   # a JSON output's (in a string, after a backslash)
    pool: PoolState | None = None        # an embedding request's pooling: it never samples
    section: Section | None = None       # a thinking request's section (SamplingParams.thinking)
    scoring: PromptScoring | None = None  # a request for its prompt's logprobs (SamplingParams.prompt_logprobs)


class ModelRunner:
    """Executes steps. One thread at a time; every call is synchronous and may take a while."""

    def __init__(self, model: BatchedModel, *, num_blocks: int, block_size: int,
                 eos_token_id: int | None, kv_cache_dtype: str = "float32",
                 grammars: Grammars | None = None, end_token_ids: Iterable[int] = (),
                 draft_model: LlamaModel | None = None, draft_layers: int | None = None,
                 draft_p_min: float = 0.0) -> None:
        self.model = model
        self.block_size = block_size
        if kv_cache_dtype == "int8" and isinstance(model, LlamaModel) and model.weights.det:
            raise ConfigError("--numerics deterministic takes a float32, float16 or bfloat16 K/V cache, not int8 "
                              "(its attention reads the cache's values exactly; an int8 cache is rotated and scaled)")
        self.kv = model.new_kv_cache(num_blocks, block_size, kv_cache_dtype)
        # Who fills in the guesses of --speculative draft (forge.spec_decode.draft_model): a second model, or the
        # target's first layers; None: no step carries placeholder guesses.
        self.drafter: DraftModel | None = None
        if draft_model is not None or draft_layers is not None:
            if not isinstance(model, LlamaModel):
                raise ConfigError("speculative decoding with a draft model needs a LlamaModel target")
            self.drafter = (DraftModel.separate(draft_model, model, num_blocks=num_blocks, block_size=block_size,
                                                dtype=kv_cache_dtype, p_min=draft_p_min)
                            if draft_model is not None
                            else DraftModel.first_layers(model, self.kv, draft_layers or 0, p_min=draft_p_min))
        self.deterministic = isinstance(model, LlamaModel) and model.det       # the deterministic numerics
        self.sampler = Sampler(eos_token_id=eos_token_id, end_token_ids=end_token_ids,
                               deterministic=self.deterministic)
        self.eos_token_id = eos_token_id
        self.grammars = grammars        # None: constrained requests cannot run here
        # Follows thinking sections over the vocabulary's bytes (forge.sampling.reasoning); None: no vocabulary here
        self.sections = SectionFollower(grammars.vocabulary) if grammars is not None else None
        self._masker: ThreadPoolExecutor | None = None
        self._seqs: dict[int, _SeqSampling] = {}

    def num_tracked(self) -> int:
        return len(self._seqs)

    def commit_kv_memory(self) -> float:
        """Write every page of the K/V cache (and a separate draft's) once, on the matmul pool's
        threads (KVCache.commit_memory); returns the seconds it took. Caches of another kind have
        nothing to commit; a draft of the target's first layers shares the target's."""
        started = time.perf_counter()
        caches = [self.kv]
        if self.drafter is not None and not np.may_share_memory(self.drafter.kv.k, self.kv.k):
            caches.append(self.drafter.kv)
        pool = active_pool()
        for cache in caches:
            if isinstance(cache, KVCache):
                cache.commit_memory(pool.run_parts, pool.num_parts)
        return time.perf_counter() - started

    def execute(self, step: StepBatch) -> StepOutput:
        """Run one step. A fault in it (an exception in the forward or the sampler, non-finite logits)
        fails the step's sequences, whose sampling state is dropped, and nothing else."""
        t0 = time.perf_counter()
        try:
            return self._execute(step, t0)
        except Exception as exc:      # noqa: BLE001 - one bad step must not take the engine down
            failed = tuple(c.seq_id for c in step.chunks)
            for seq_id in failed:
                self._forget(seq_id)
            return StepOutput(step_id=step.step_id, sampled=(), failed=failed, error=f"{type(exc).__name__}: {exc}",
                              elapsed_s=time.perf_counter() - t0)

    def _execute(self, step: StepBatch, t0: float) -> StepOutput:
        for seq_id in step.dropped:
            self._forget(seq_id)
        for new in step.new_seqs:
            p = new.params
            counts = TokenHistory(new.prompt_ids) if p.has_penalties else None
            self._seqs[new.seq_id] = _SeqSampling(p, make_generator(p.seed), counts, self._matcher(p),
                                                  pool=PoolState(p.pooling) if p.pooling is not None else None,
                                                  section=self._section(p, new.prompt_ids),
                                                  scoring=(PromptScoring(new.prompt_ids, p.prompt_logprobs,
                                                                         p.logit_bias,
                                                                         deterministic=self.deterministic)
                                                           if p.prompt_logprobs is not None else None))
        if not step.chunks:
            return StepOutput(step_id=step.step_id, sampled=())
        step_chunks: tuple[SeqChunk, ...] = step.chunks
        guesses: tuple[tuple[int, int], ...] = ()
        if self.drafter is not None:            # a draft model fills in the guesses, maybe fewer than asked
            step_chunks = self.drafter.propose(step.chunks)
            guesses = tuple((c.seq_id, c.num_draft) for c, asked in zip(step_chunks, step.chunks, strict=True)
                            if c.num_draft < asked.num_draft)
        pooled = [(i, c) for i, c in enumerate(step_chunks) if self._seqs[c.seq_id].pool is not None]
        if pooled:                              # their last chunks return a vector, not a sampled token
            step_chunks = tuple(msgspec.structs.replace(c, samples=False) if self._seqs[c.seq_id].pool else c
                                for c in step_chunks)
        scored = [(i, c) for i, c in enumerate(step_chunks)
                  if (scoring := self._seqs[c.seq_id].scoring) is not None and not scoring.done]
        batch = build_forward_batch(step_chunks, self.block_size)
        chunks = [c for c in step_chunks if c.samples]
        states = [self._seqs[c.seq_id] for c in chunks]
        masks = self._start_masks(chunks, states)
        embeddings: tuple[Embedding, ...] = ()
        prompt_logprobs: tuple[PromptLogprobs, ...] = ()
        if pooled or scored:
            logits, embeddings, prompt_logprobs = self._forward_rows(batch, pooled, scored)   # [R, V]
        else:
            logits = self.model.forward(batch, self.kv)                            # [R, V]
        if not chunks:
            return StepOutput(step_id=step.step_id, sampled=(), num_tokens=batch.num_tokens,
                              elapsed_s=time.perf_counter() - t0, guesses=guesses, embeddings=embeddings,
                              prompt_logprobs=prompt_logprobs)
        # One logits row per sampled position: a chunk with d drafts has d + 1, and each draws as a
        # plain decode step would (its generator's next uniform, its count of tokens so far, its
        # grammar's mask after the drafts before it).
        widths = [c.num_draft + 1 for c in chunks]
        row_states = [s for s, w in zip(states, widths, strict=True) for _ in range(w)]
        rewind = [s.generator.bit_generator.state if c.num_draft and not s.params.is_greedy else None
                  for c, s in zip(chunks, states, strict=True)]
        allowed = self._allowed(chunks, states, masks, logits.shape[1]) if masks is not None else []
        allowed = self._force_closes(chunks, states, allowed, logits.shape[1])
        out = self.sampler.sample(logits, SamplingBatch(
            params=[s.params for s in row_states], generators=[s.generator for s in row_states],
            counts=[s.counts for s in row_states],
            num_output_tokens=[c.num_output_tokens + j for c in chunks for j in range(c.num_draft + 1)],
            allowed=allowed))
        tokens, logprobs = out.token_ids.tolist(), out.logprobs
        sampled = []
        reasoning: list[tuple[int, int]] = []
        row = 0
        for c, state, width, saved in zip(chunks, states, widths, rewind, strict=True):
            drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
            kept = 0          # verification: a draft is kept while it is the token its row drew
            while kept < c.num_draft and tokens[row + kept] == drafts[kept]:
                kept += 1
            if self.drafter is not None:
                self.drafter.kept(c, kept)
            if saved is not None:       # the rows past the first mismatch drew for nothing: undo them
                state.generator.bit_generator.state = saved
                state.generator.random(kept + 1)
            for j in range(kept + 1):
                token, lp = tokens[row + j], logprobs[row + j]
                if state.counts is not None:
                    state.counts.add(token)
                if state.section is not None and state.params.thinking is not None and self.sections is not None:
                    state.section, inside = self.sections.advance(state.section, token, state.params.thinking)
                    if inside:
                        reasoning.append((c.seq_id, 1))
                if state.matcher is not None:
                    state.matcher.consume_token(token)   # an illegal token leaves it in error: only the end follows
                    if state.params.close_within and self.grammars is not None:
                        state.json_state = self.grammars.closing.advance(state.json_state, token)
                if lp is None:
                    sampled.append(SampledToken(seq_id=c.seq_id, token_id=token))
                else:
                    sampled.append(SampledToken(seq_id=c.seq_id, token_id=token, logprob=lp.logprob,
                                                top_logprobs=lp.top))
            row += width
        return StepOutput(step_id=step.step_id, sampled=tuple(sampled), num_tokens=batch.num_tokens,
                          elapsed_s=time.perf_counter() - t0, guesses=guesses, embeddings=embeddings,
                          reasoning=_summed(reasoning), prompt_logprobs=prompt_logprobs)

    def _forward_rows(self, batch: ForwardBatch, pooled: list[tuple[int, SeqChunk]], scored: list[tuple[int, SeqChunk]],
                      ) -> tuple[F32, tuple[Embedding, ...], tuple[PromptLogprobs, ...]]:
        """The forward with the hidden rows the pooling chunks read and those that score prompt tokens (each
        list: (index in the step, the chunk as scheduled)); the logits, the vectors of the pooling sequences
        whose prompt ended here, and the prompt tokens scored."""
        pools = [self._seqs[c.seq_id].pool for _, c in pooled]
        scorings = [self._seqs[c.seq_id].scoring for _, c in scored]
        spans = []
        for (i, c), reader in zip(pooled + scored, [*pools, *scorings], strict=True):
            assert reader is not None
            lo, hi = reader.rows(c)
            spans.append((int(batch.query_start[i]) + lo, hi - lo))
        rows = np.concatenate([np.arange(a, a + n, dtype=np.int64) for a, n in spans])  # [M]
        logits, hidden = self.model.forward_hidden(batch, self.kv, rows)           # [R, V], [M, H]
        vectors, scores, offset = [], [], 0
        for (_, c), (_, n), pool in zip(pooled, spans[:len(pooled)], pools, strict=True):
            assert pool is not None
            vector = pool.add(c, hidden[offset:offset + n])
            offset += n
            if vector is not None:
                vectors.append(Embedding(seq_id=c.seq_id, vector=vector_bytes(vector)))
        for (_, c), (_, n), scoring in zip(scored, spans[len(pooled):], scorings, strict=True):
            assert scoring is not None
            if n:
                scores.append(scoring.score(c.seq_id, hidden[offset:offset + n], self.model.head_logits))
            offset += n
        return logits, tuple(vectors), tuple(scores)

    def _forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq_id)

    # ---- thinking sections ------------------------------------------------------------------

    def _section(self, params: SamplingParams, prompt_ids: tuple[int, ...]) -> Section | None:
        if params.thinking is None:
            return None
        if self.sections is None:
            raise EngineError("this runner has no vocabulary to follow a thinking section")
        return self.sections.start(prompt_ids)

    def _force_closes(self, chunks: list[SeqChunk], states: list[_SeqSampling], allowed: list[BoolArray | None],
                      width: int) -> list[BoolArray | None]:
        """`allowed` with the rows whose thinking budget is spent (or whose close is under way) narrowed to the
        one closing token due there: a row after drafts, as its section stands after them. The forced token
        wins over a grammar's mask (a constrained request has no section: the gateway sees to that)."""
        if self.sections is None or not any(s.section is not None for s in states):
            return allowed
        rows: list[BoolArray | None] = list(allowed) if allowed else [None] * sum(c.num_draft + 1 for c in chunks)
        row = 0
        for c, s in zip(chunks, states, strict=True):
            section, thinking = s.section, s.params.thinking
            if section is not None and thinking is not None:
                drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
                for j in range(c.num_draft + 1):
                    forced = self.sections.forced(section, thinking)
                    if forced is not None:
                        one = np.zeros(width, np.bool_)
                        one[forced] = True
                        rows[row + j] = one
                    if j < len(drafts):
                        section, _ = self.sections.advance(section, drafts[j], thinking)
            row += c.num_draft + 1
        return rows

    # ---- grammar masks ----------------------------------------------------------------------

    def _matcher(self, params: SamplingParams) -> Any:
        if params.grammar is None:
            return None
        if self.grammars is None:
            raise EngineError("this runner has no grammar engine for a constrained request")
        return self.grammars.matcher(params.grammar)

    def _start_masks(self, chunks: list[SeqChunk], states: list[_SeqSampling]) -> Future[I32] | None:
        """The constrained rows' masks (a chunk with drafts: one per row, each after the drafts before
        it), computed on a helper thread (llguidance drops the GIL) while the forward runs; None when
        no row is constrained."""
        work = [(s.matcher, c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ())
                for c, s in zip(chunks, states, strict=True) if s.matcher is not None]
        if not work or self.grammars is None:
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forge-masks")
        return self._masker.submit(self.grammars.fill_masks, [m for m, _ in work], [d for _, d in work])

    def _allowed(self, chunks: list[SeqChunk], states: list[_SeqSampling], masks: Future[I32],
                 width: int) -> list[BoolArray | None]:
        """One mask per sampled row (None for an unconstrained one). A JSON row within its params'
        close_within of max_tokens keeps only the allowed tokens that close something, when there are any."""
        bitmasks = iter(masks.result())
        allowed: list[BoolArray | None] = []
        for c, s in zip(chunks, states, strict=True):
            json_state = s.json_state
            drafts = c.token_ids[len(c.token_ids) - c.num_draft:] if c.num_draft else ()
            for j in range(c.num_draft + 1):
                if s.matcher is None:
                    allowed.append(None)
                    continue
                row = allowed_tokens(next(bitmasks), width)
                if not row.any() and self.eos_token_id is not None:   # a matcher in error: end the sequence
                    row = row.copy()
                    row[self.eos_token_id] = True
                elif s.params.max_tokens - (c.num_output_tokens + j) <= s.params.close_within:
                    row = self._closing(row, json_state)
                if j < len(drafts) and s.params.close_within and self.grammars is not None:
                    json_state = self.grammars.closing.advance(json_state, drafts[j])
                allowed.append(row)
        return allowed

    def _closing(self, row: BoolArray, json_state: tuple[bool, bool]) -> BoolArray:
        assert self.grammars is not None
        closing = self.grammars.closing.mask(json_state)
        kept = row.copy()
        kept[: closing.size] &= closing
        kept[closing.size:] = False
        return kept if kept.any() else row


def _summed(pairs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(seq id, count) pairs with one entry per seq id, counts added, in first-seen order."""
    totals: dict[int, int] = {}
    for seq_id, num in pairs:
        totals[seq_id] = totals.get(seq_id, 0) + num
    return tuple(totals.items())
