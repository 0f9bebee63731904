"""Every message that crosses an actor boundary. Pure data: frozen, keyword-only, tagged Structs.

The core uses the same records offline (the engine calls the allocator directly), so the daemon and
the library run one scheduling logic. Replies are routed by request or sequence id, never by
channels inside messages.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from forge.errors import RequestError
from forge.sampling.sampling_params import SamplingParams


class ActorMessage(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Immutable, keyword-only, tagged by class name.

    Subclasses repeat frozen=True: msgspec inherits it, but type checkers would see them mutable.
    """


# ---- scheduler <-> cache allocator ----------------------------------------------------------

class BlockAsk(ActorMessage, frozen=True):
    """One sequence's wish for this step, in priority order (running first, then waiting)."""
    seq_id: int
    new_token_ids: tuple[int, ...]   # tokens the allocator has not seen yet for this sequence
    max_compute: int                 # most tokens to compute this step (its share of the budget)
    is_running: bool                 # False: admit it now (prefix lookup) if blocks and budget allow
    num_computed: int | None = None  # running: tokens whose K/V are kept (drafts past them were
                                     # rejected: their slots are taken back); None: all it holds
    num_lookahead: int = 0           # slots for draft tokens after the real ones, if blocks allow
    cache_salt: str | None = None    # waiting: share prefix blocks only with sequences of this salt
    use_prefix_cache: bool = True    # waiting: False to compute every token (pooling, prompt logprobs read them all)


class Grant(ActorMessage, frozen=True):
    seq_id: int
    num_cached: int                  # leading tokens found in the prefix cache (new sequences)
    start: int                       # first position computed this step
    num_tokens: int                  # tokens computed this step (may be 0)
    block_ids: tuple[int, ...]       # the sequence's whole block table after this step
    num_lookahead: int = 0           # draft slots granted after those tokens


class AllocateStep(ActorMessage, frozen=True):
    frees: tuple[int, ...]           # sequences that finished or were aborted since the last step
    asks: tuple[BlockAsk, ...]
    admit_budget: int | None = None  # tokens the waiting asks may compute in all, counted after
                                     # their prefix-cache hits; None: no limit
    flush_prefix_cache: bool = False  # drop every cached block first (POST /flush_cache)


class StepAllocation(ActorMessage, frozen=True):
    grants: tuple[Grant, ...]
    preempted: tuple[int, ...]       # running sequences whose blocks were taken back, in order
    num_free_blocks: int
    num_total_blocks: int
    num_flushed: int = 0             # cached blocks the flush dropped


class CacheStats(ActorMessage, frozen=True):
    num_free_blocks: int
    num_total_blocks: int
    prefix_hit_rate: float
    prefix_queries: int = 0              # prompt tokens looked up since start, found, and missed by reason
    prefix_hits: int = 0
    prefix_misses: tuple[tuple[str, int], ...] = ()


FinishReason = Literal["stop", "length"]   # an aborted request ends without one: nobody reads it


# ---- scheduler <-> model worker -------------------------------------------------------------

class SeqChunk(ActorMessage, frozen=True):
    """Tokens of one sequence to compute this step."""
    seq_id: int
    token_ids: tuple[int, ...]
    start: int                       # position of token_ids[0]
    block_ids: tuple[int, ...]
    samples: bool                    # the chunk ends the sequence: sample its next token
    num_output_tokens: int           # tokens the request has emitted so far (for min_tokens)
    num_draft: int = 0               # the last num_draft of token_ids are drafts: sample every one of
                                     # the last num_draft + 1 positions, keep drafts up to a mismatch


class NewSeq(ActorMessage, frozen=True):
    """Sampling state the worker keeps for a sequence from its first step until it is dropped."""
    seq_id: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


class StepBatch(ActorMessage, frozen=True):
    step_id: int
    chunks: tuple[SeqChunk, ...]
    new_seqs: tuple[NewSeq, ...] = ()
    dropped: tuple[int, ...] = ()    # sequences that ended: forget their sampling state


class SampledToken(ActorMessage, frozen=True):
    """A sampled token, or a prompt token scored (SamplingParams.prompt_logprobs): its logprob and the top
    alternatives (None and () where not asked, and for the prompt's first token, which nothing predicts)."""
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    rank: int | None = None          # a prompt token's: how many tokens are at least as likely (1: the likeliest)


class PromptLogprobs(ActorMessage, frozen=True):
    """Prompt tokens of one sequence scored in a step: tokens[i] is the prompt token at position start + i,
    with the logprob the model gave it after the tokens before it."""
    seq_id: int
    start: int
    tokens: tuple[SampledToken, ...]


class Embedding(ActorMessage, frozen=True):
    """A pooling sequence's vector, once its prompt has run: L2-normalised float32, little-endian."""
    seq_id: int
    vector: bytes


class StepOutput(ActorMessage, frozen=True):
    step_id: int
    sampled: tuple[SampledToken, ...]
    num_tokens: int = 0              # tokens computed in the step
    elapsed_s: float = 0.0
    failed: tuple[int, ...] = ()     # the step raised: these sequences (all of its chunks) end in error
    error: str | None = None
    # (seq id, guesses carried) for each sequence whose draft model stopped guessing before it had
    # filled the guesses the scheduler budgeted (forge.spec_decode.draft_model: unsure of its next guess)
    guesses: tuple[tuple[int, int], ...] = ()
    embeddings: tuple[Embedding, ...] = ()   # the pooling sequences whose prompt ended this step
    # (seq id, tokens) for each thinking sequence (SamplingParams.thinking) with sampled tokens that fell
    # inside its thinking section this step
    reasoning: tuple[tuple[int, int], ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()   # prompt tokens scored this step, per sequence that asked


# ---- scheduler -> tokenizer ------------------------------------------------------------------

class TokenCounts(ActorMessage, frozen=True):
    """One request's token counts so far, as usage reports them. Every count is cumulative, so a
    later one replaces an earlier; 0 means not counted where this was made (the engine does not
    count completion tokens: the tokenizer does, after stop strings)."""
    prompt: int = 0
    completion: int = 0
    cached: int = 0              # prompt tokens found in the prefix cache
    draft: int = 0               # speculation: draft tokens proposed, and kept
    accepted: int = 0
    reasoning: int = 0           # generated tokens inside a thinking section (forge.sampling.reasoning)

    def merge(self, later: TokenCounts) -> TokenCounts:
        """These counts updated by a later message's."""
        return TokenCounts(prompt=later.prompt or self.prompt, completion=later.completion or self.completion,
                           cached=later.cached or self.cached, draft=later.draft or self.draft,
                           accepted=later.accepted or self.accepted, reasoning=later.reasoning or self.reasoning)


class TokensEmitted(ActorMessage, frozen=True):
    """New tokens of one request, and its end when finish_reason is set."""
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[SampledToken, ...] = ()     # one per token when the request asked
    # The whole prompt's tokens scored (SamplingParams.prompt_logprobs), once: with the first token, or with
    # the end of a request that generates none (max_tokens 0); the first one's logprob is None
    prompt_logprobs: tuple[SampledToken, ...] = ()
    finish_reason: FinishReason | None = None
    counts: TokenCounts = TokenCounts()
    error: str | None = None                    # the request ended in a fault of the engine (no tokens)
    embedding: bytes | None = None              # an embedding request's vector (Embedding.vector), at its end


# ---- gateway -> tokenizer -> scheduler (one ordered path: an Abort never overtakes its Submit) --

class Submit(ActorMessage, frozen=True):
    """A request as the gateway accepted it; exactly one of text, token_ids, messages is set."""
    request_id: str
    params: SamplingParams
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None   # for a chat template that renders tools itself
    template_kwargs: dict[str, Any] | None = None     # a chat's chat_template_kwargs (enable_thinking)
    add_special_tokens: bool = True


class FlushCache(ActorMessage, frozen=True):
    """Drop the prefix cache (gateway -> tokenizer -> scheduler -> allocator, on the requests' path);
    answered with Accepted for `request_id` when done."""
    request_id: str


class Tokenized(ActorMessage, frozen=True):
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


class Abort(ActorMessage, frozen=True):
    """Drop a request: its client went away (gateway -> tokenizer -> scheduler), or a stop string
    ended it (tokenizer -> scheduler). Never answered: whoever sends it has already let go."""
    request_id: str
    by_client: bool = True           # False: a stop string ended it (a success, not an abort)


# ---- to the stream demultiplexer (the gateway's per-request streams), all through the tokenizer -------------
#      Accepted/Rejected: the scheduler's verdict, relayed; TextDelta: the tokenizer's own text.

class Accepted(ActorMessage, frozen=True):
    """The scheduler queued the request: from here the response is a success."""
    request_id: str
    num_prompt_tokens: int


class Rejected(ActorMessage, frozen=True):
    """The request will not run: a RequestError, as data (it crosses actors; exceptions do not)."""
    request_id: str
    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, request_id: str, exc: RequestError) -> Rejected:
        return cls(request_id=request_id, status=exc.status, message=exc.message, error_type=exc.type,
                   param=exc.param, code=exc.code)

    def error(self) -> RequestError:
        return RequestError(self.message, param=self.param, status=self.status, type=self.error_type,
                            code=self.code)


class TokenLogprobInfo(ActorMessage, frozen=True):
    """A token's logprob as the gateway renders it: its text and bytes, and its top alternatives as (text,
    bytes, logprob), best first. A prompt token's also carries its rank and its alternatives' ids (what vLLM's
    prompt_logprobs lists); the prompt's first token has no logprob (None)."""
    token_id: int
    text: str
    token_bytes: bytes
    logprob: float | None
    top: tuple[tuple[str, bytes, float], ...] = ()
    rank: int | None = None
    top_ids: tuple[int, ...] = ()


class TextDelta(ActorMessage, frozen=True):
    """New text of one request; the last one carries finish_reason and the token counts."""
    request_id: str
    text: str
    num_tokens: int                              # tokens behind this text
    logprobs: tuple[TokenLogprobInfo, ...] = ()
    prompt_logprobs: tuple[TokenLogprobInfo, ...] = ()   # the prompt's tokens scored, once (TokensEmitted's)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None               # the stop string that ended it ("stop"), if one did
    counts: TokenCounts = TokenCounts()
    error: str | None = None                     # ended by a fault of the engine: the last delta
    embedding: bytes | None = None               # an embedding request's vector: the last delta


DaemonEvent = Accepted | Rejected | TextDelta
