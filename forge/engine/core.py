"""The request side of the batching loop: requests in, step batches out, tokens and stops back.

EngineCore owns the scheduler and each request's stop rules; it never runs the model and never
owns blocks. One step is propose() -> [allocator] -> build() -> [model runner] -> apply(). The
offline engine calls the allocator and runner directly; the daemon's scheduler actor sends the
same messages to the allocator and model worker actors.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from forge.engine.block_table import CacheLayout
from forge.engine.scheduler import Scheduler, SchedulerConfig
from forge.engine.sequence import Sequence
from forge.errors import InvalidRequest, PromptTooLong
from forge.messages import (
    AllocateStep,
    FinishReason,
    NewSeq,
    SampledToken,
    SeqChunk,
    StepAllocation,
    StepBatch,
    StepOutput,
    TokenCounts,
    TokensEmitted,
)
from forge.sampling.sampling_params import SamplingParams
from forge.spec_decode.speculation import Lookahead


@dataclass(slots=True)
class _Request:
    request_id: str
    seq: Sequence
    params: SamplingParams
    stop_ids: frozenset[int]
    is_known_to_runner: bool = False
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_reasoning_tokens: int = 0
    # Its prompt's tokens scored so far (SamplingParams.prompt_logprobs), the first one's logprob None: sent
    # whole with its first event, then None. None: not asked, or sent.
    prompt_logprobs: list[SampledToken] | None = None


@dataclass(frozen=True, slots=True)
class CoreStats:
    num_running: int
    num_waiting: int
    num_preemptions: int


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding since start, with vLLM's meanings: drafts (sequence-steps that carried
    drafts), draft tokens proposed, drafts accepted, and accepted by position in the draft."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position.append(0)
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class EngineCore:
    def __init__(self, config: SchedulerConfig, layout: CacheLayout, *, eos_token_id: int | None,
                 max_model_len: int, vocab_size: int, end_token_ids: Iterable[int] = ()) -> None:
        self.scheduler = Scheduler(config, layout)
        self.eos_token_id = eos_token_id
        # eos and the model's other end-of-turn tokens (Tokenizer.end_token_ids): each ends a request
        self.end_token_ids = frozenset(end_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._requests: dict[int, _Request] = {}
        self._seq_of: dict[str, int] = {}
        self._ids = itertools.count()
        self._steps = itertools.count()
        self._to_drop: list[int] = []
        # (step id, sequences) whose prompt-only request (max_tokens 0) ends with that step (its last prompt chunk)
        self._prompt_ends: tuple[int, tuple[int, ...]] = (-1, ())
        self.spec = SpecStats()
        self._spec_config = self.scheduler.config.speculative

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """Queue a request; raises a RequestError for one that can never run."""
        if request_id in self._seq_of:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if not prompt_ids:
            raise InvalidRequest("the prompt must contain at least one token", param="prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})", param="prompt")
        params.validate(vocab_size=self.vocab_size)
        if params.pooling is not None:
            return self._add_pooling(request_id, prompt_ids, params)
        room = self.max_model_len - len(prompt_ids)
        if room < min(params.max_tokens, 1):
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {len(prompt_ids)} tokens"
                f"{', leaving no room for the completion' if params.max_tokens else ''}.", param="prompt")
        params = params.limited_to(room)      # clamped once, here: every reader sees this limit
        # max_tokens 0: the prompt runs to its end (build() takes no token from it) and the request ends there
        seq = Sequence(next(self._ids), prompt_ids, max(params.max_tokens, 1))
        seq.cache_salt = params.cache_salt
        seq.priority, seq.tenant, seq.share = params.priority, params.tenant, params.tenant_share
        # Scoring the prompt reads every position's logits: none may come from the prefix cache.
        seq.reads_all_states = params.prompt_logprobs is not None
        if self._spec_config.enabled and not params.has_penalties and params.max_tokens > 0:
            # Penalties depend on every token before a position: those sequences decode one token a
            # step. (A grammar's masks after each draft come from llguidance: forge.sampling.structured.)
            seq.lookahead = Lookahead(self._spec_config.num_tokens)
        self.scheduler.submit(seq)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.end_token_ids
        self._requests[seq.id] = _Request(request_id, seq, params, stop_ids, prompt_logprobs=(
            [SampledToken(seq_id=seq.id, token_id=prompt_ids[0])] if params.prompt_logprobs is not None else None))
        self._seq_of[request_id] = seq.id
        return seq.id

    def _add_pooling(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> int:
        """An embedding request: a prompt-only sequence whose last prompt chunk returns its pooled
        vector instead of a sampled token; it ends there (apply), and its blocks are freed."""
        if len(prompt_ids) > self.max_model_len:
            raise PromptTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your input has {len(prompt_ids)} tokens.", param="input")
        seq = Sequence(next(self._ids), prompt_ids, 1)   # one "token": the vector, so it runs to its end
        seq.cache_salt = params.cache_salt
        seq.priority, seq.tenant, seq.share = params.priority, params.tenant, params.tenant_share
        seq.reads_all_states = params.pooling != "last"  # last: a cached prefix's K/V are all it needs
        self.scheduler.submit(seq)
        self._requests[seq.id] = _Request(request_id, seq, params, frozenset())
        self._seq_of[request_id] = seq.id
        return seq.id

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is. Its blocks are freed in the next allocation."""
        seq_id = self._seq_of.pop(request_id, None)
        if seq_id is None:
            return False
        self.scheduler.abort(seq_id)
        self._forget(seq_id)
        return True

    def phase(self, request_id: str) -> str | None:
        """Where a request is: "queued" (waiting or preempted), "prefill" (running, nothing emitted
        yet), "decode"; None for one unknown here."""
        seq_id = self._seq_of.get(request_id)
        if seq_id is None:
            return None
        seq = self._requests[seq_id].seq
        if self.scheduler.running_seq(seq_id) is None:
            return "queued"
        return "decode" if seq.output else "prefill"

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._to_drop)

    def stats(self) -> CoreStats:
        s = self.scheduler
        return CoreStats(s.running_len(), s.waiting_len(), s.num_preemptions)

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables (requests, the scheduler's sequences, drops not yet sent)."""
        return {"core.requests": len(self._requests), "core.seq_of": len(self._seq_of),
                "core.to_drop": len(self._to_drop), **self.scheduler.tracked()}

    def num_cached_tokens(self, request_id: str) -> int:
        seq_id = self._seq_of.get(request_id)
        return self._requests[seq_id].seq.num_cached_tokens if seq_id is not None else 0

    # ---- one step -----------------------------------------------------------------------

    def propose(self) -> AllocateStep:
        return self.scheduler.propose()

    def build(self, alloc: StepAllocation) -> StepBatch:
        plan = self.scheduler.commit(alloc)
        chunks, new_seqs, ends = [], [], []
        for s in plan.scheduled:
            req = self._requests[s.seq_id]
            seq = req.seq
            if not req.is_known_to_runner:
                req.is_known_to_runner = True
                new_seqs.append(NewSeq(seq_id=seq.id, prompt_ids=tuple(seq.prompt), params=req.params))
            token_ids = seq.tokens(s.start, s.start + s.num_tokens) + seq.draft[: s.num_draft]
            samples = s.samples
            if samples and req.params.max_tokens == 0:     # the prompt's last chunk: it ends with this step
                samples = False
                ends.append(seq.id)
            chunks.append(SeqChunk(seq_id=seq.id, token_ids=tuple(token_ids), start=s.start, block_ids=s.block_ids,
                                   samples=samples, num_output_tokens=len(seq.output), num_draft=s.num_draft))
        dropped, self._to_drop = tuple(self._to_drop), []
        step_id = next(self._steps)
        self._prompt_ends = (step_id, tuple(ends))
        return StepBatch(step_id=step_id, chunks=tuple(chunks), new_seqs=tuple(new_seqs), dropped=dropped)

    def apply(self, output: StepOutput) -> list[TokensEmitted]:
        """Record sampled tokens (a sequence that carried drafts may have several: the drafts kept, then
        one more); finish requests that meet a stop rule, at the first token that meets it."""
        self.scheduler.observe_step(output.num_tokens, output.elapsed_s)
        events = []
        for seq_id in output.failed:                 # the step raised: its sequences end in error
            req = self._requests.get(seq_id)
            if req is None:
                continue
            events.append(TokensEmitted(request_id=req.request_id, token_ids=(), error=output.error or "engine fault",
                                        counts=TokenCounts(prompt=len(req.seq.prompt))))
            self.scheduler.abort(seq_id)
            del self._seq_of[req.request_id]
            self._forget(seq_id)
        for seq_id, num_guesses in output.guesses:   # the draft model guessed fewer than budgeted
            req = self._requests.get(seq_id)
            if req is not None:
                req.seq.draft = req.seq.draft[:num_guesses]
                if num_guesses == 0 and req.seq.lookahead is not None:
                    req.seq.lookahead.observe(1, 0)      # a try that cost a draft pass and kept nothing
        for emb in output.embeddings:                # pooling sequences end at their prompt's end
            req = self._requests.get(emb.seq_id)
            if req is not None:
                events.append(self._emitted(req, [], "stop", embedding=emb.vector))
        for seq_id, num in output.reasoning:
            if (req := self._requests.get(seq_id)) is not None:
                req.num_reasoning_tokens += num
        for part in output.prompt_logprobs:
            req = self._requests.get(part.seq_id)
            if req is not None and req.prompt_logprobs is not None and part.start == len(req.prompt_logprobs):
                req.prompt_logprobs.extend(part.tokens)
        step_id, ends = self._prompt_ends
        for seq_id in ends if step_id == output.step_id else ():
            if (req := self._requests.get(seq_id)) is not None:   # not failed, nor aborted meanwhile
                events.append(self._emitted(req, [], "length"))
        counts: dict[int, int] = {}
        for tok in output.sampled:
            counts[tok.seq_id] = counts.get(tok.seq_id, 0) + 1
        for seq_id, num in counts.items():
            req = self._requests.get(seq_id)
            if req is not None and req.seq.draft:
                self.spec.add(len(req.seq.draft), num - 1)
                req.num_draft_tokens += len(req.seq.draft)
                req.num_accepted_tokens += num - 1
                self.scheduler.accept_drafts(seq_id, num - 1)
        # One event per sequence per step, with all the tokens it kept: a stream gets a step's
        # accepted drafts in one frame, not several frames microseconds apart.
        runs: dict[int, list[SampledToken]] = {}
        for tok in output.sampled:
            req = self._requests.get(tok.seq_id)
            if req is None:            # aborted while its step ran, or finished by an earlier token
                continue
            seq = req.seq
            self.scheduler.push_token(seq.id, tok.token_id)
            runs.setdefault(seq.id, []).append(tok)
            # Under a grammar the end comes when the grammar allows it, min_tokens or not.
            if tok.token_id in req.stop_ids and (len(seq.output) >= req.params.min_tokens
                                                 or req.params.grammar is not None):
                events.append(self._emitted(req, runs.pop(seq.id), "stop"))
            elif seq.is_complete():
                events.append(self._emitted(req, runs.pop(seq.id), "length"))
        for seq_id, run in runs.items():
            events.append(self._emitted(self._requests[seq_id], run, None))
        return events

    def _emitted(self, req: _Request, run: list[SampledToken], reason: FinishReason | None, *,
                 embedding: bytes | None = None) -> TokensEmitted:
        seq = req.seq
        scored, req.prompt_logprobs = tuple(req.prompt_logprobs or ()), None
        event = TokensEmitted(request_id=req.request_id, token_ids=tuple(t.token_id for t in run),
                              logprobs=tuple(run) if req.params.logprobs is not None else (),
                              prompt_logprobs=scored, finish_reason=reason, embedding=embedding,
                              counts=TokenCounts(prompt=len(seq.prompt), cached=seq.num_cached_tokens,
                                                 draft=req.num_draft_tokens, accepted=req.num_accepted_tokens,
                                                 reasoning=req.num_reasoning_tokens))
        if reason is not None:
            self.scheduler.finish(seq.id)
            del self._seq_of[req.request_id]
            self._forget(seq.id)
        return event

    def _forget(self, seq_id: int) -> None:
        req = self._requests.pop(seq_id)
        if req.is_known_to_runner:
            self._to_drop.append(seq_id)
