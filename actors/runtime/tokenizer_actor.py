"""The tokenizer actor: prompts to token ids, sampled ids back to text, stop strings.

Prompt text, token ids or chat messages become ids under the model's chat template. Sampled ids
become text incrementally (never half a UTF-8 character, never the start of a stop string); a
stop string ends the request here and tells the scheduler to drop it.

It is the one way in and out of the engine for a request: the gateway's Submit and Abort come
here in order (so an Abort can never overtake its request), and it is the only task that feeds
the stream demultiplexer, so a request's verdict (Accepted or Rejected, relayed from the scheduler) always
reaches its reader before its text. Its own state for a request lives from Submit until the
request ends (finish, stop string, abort or rejection).

The work proportional to a request's size (rendering the chat template, encoding the prompt,
building the stop-string automaton) runs in a worker thread of its own, one request at a time in
the order they came, while the actor goes on relaying other requests' text: a megabyte of prompt
stalls neither the event loop nor another stream. A prompt whose bytes alone prove it longer than
the context is refused before it is encoded. A request aborted while it is being prepared never
reaches the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.ops.metrics import ModelMetrics
from actors.runtime.scheduler_actor import SchedulerInbox
from actors.runtime.stream_demux import StreamDemux
from forge.errors import InvalidRequest, PromptTooLong, RequestError
from forge.messages import (
    Abort,
    Accepted,
    FlushCache,
    Rejected,
    SampledToken,
    Submit,
    TextDelta,
    TokenCounts,
    Tokenized,
    TokenLogprobInfo,
    TokensEmitted,
)
from forge.text.chat_template import ChatTemplate
from forge.text.detokenizer import IncrementalDetokenizer
from forge.text.tokenizer import Tokenizer

TokenizerInbox = Submit | Abort | FlushCache | Accepted | Rejected | TokensEmitted


@dataclass(slots=True)
class _Stream:
    detok: IncrementalDetokenizer
    num_prompt_tokens: int
    num_tokens: int = 0


class TokenizerActor:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, demux: StreamDemux, metrics: ModelMetrics, *,
                 inbox: MemoryObjectReceiveStream[TokenizerInbox],
                 to_scheduler: MemoryObjectSendStream[SchedulerInbox], max_model_len: int | None = None) -> None:
        """`max_model_len`: the context served; a prompt that cannot fit is refused before it is encoded
        when its size alone shows it (None: the engine's own check only)."""
        self._tok = tokenizer
        self._max_model_len = max_model_len
        self._template = template
        self._demux = demux
        self._metrics = metrics
        self._inbox = inbox
        self._to_scheduler = to_scheduler
        self._streams: dict[str, _Stream] = {}
        # Requests between their Submit and their Tokenized: whether an Abort came for them meanwhile.
        self._preparing: dict[str, bool] = {}
        self._thread = anyio.CapacityLimiter(1)   # one preparing thread: requests are prepared in order

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables: all zero when no request is in flight."""
        return {"tokenizer.streams": len(self._streams), "tokenizer.preparing": len(self._preparing)}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        to_prepare, submits = anyio.create_memory_object_stream[Submit](math.inf)
        async with self._inbox, self._to_scheduler, anyio.create_task_group() as tg:
            tg.start_soon(self._prepare_each, submits)
            task_status.started()
            async with to_prepare:
                async for msg in self._inbox:
                    match msg:
                        case Submit():
                            self._preparing[msg.request_id] = False
                            to_prepare.send_nowait(msg)
                        case FlushCache():
                            await self._to_scheduler.send(msg)
                        case Abort(request_id=rid):
                            if rid in self._preparing:       # dropped when its preparation ends
                                self._preparing[rid] = True
                            # Unknown here: it already ended (finished, stopped or rejected).
                            elif self._streams.pop(rid, None) is not None:
                                await self._to_scheduler.send(msg)
                        case Accepted():
                            self._demux.deliver(msg)
                        case Rejected():
                            self._streams.pop(msg.request_id, None)
                            self._demux.deliver(msg)
                        case TokensEmitted():
                            await self._emitted(msg)

    def encode(self, msg: Submit) -> list[int]:
        """The prompt's token ids. Raises RequestError for a prompt that cannot be encoded, or that its
        size alone shows longer than the context."""
        if msg.token_ids is not None:
            vocab = self._tok.vocab_size
            if any(t < 0 or t >= vocab for t in msg.token_ids):
                raise InvalidRequest(f"token ids must lie in [0, {vocab})", param="prompt")
            return list(msg.token_ids)
        if msg.messages is not None:
            text = self._template.render(list(msg.messages), add_generation_prompt=True, tools=msg.tools,
                                         kwargs=msg.template_kwargs)
            self._check_size(text, msg)
            return self._tok.encode(text, add_special_tokens=False)
        text = msg.text or ""
        self._check_size(text, msg)
        return self._tok.encode(text, add_special_tokens=msg.add_special_tokens)

    def _check_size(self, text: str, msg: Submit) -> None:
        limit = self._max_model_len
        if limit is None or len(text) <= limit:     # a character is at least a byte: no token more than that
            return
        at_least = self._tok.min_num_tokens(text)
        if at_least > limit:
            what = "input" if msg.params.pooling is not None else "prompt"
            raise PromptTooLong(f"This model's maximum context length is {limit} tokens. However, your {what} "
                                f"has at least {at_least} tokens ({len(text)} characters).", param=what)

    def _prepare(self, msg: Submit) -> tuple[tuple[int, ...], IncrementalDetokenizer] | RequestError:
        """In the preparing thread: the prompt's ids and the request's detokenizer, or why not."""
        try:
            ids = self.encode(msg)
        except RequestError as exc:
            return exc
        p = msg.params
        return tuple(ids), IncrementalDetokenizer(self._tok, stop=p.stop, skip_special_tokens=p.skip_special_tokens,
                                                  prompt_ids=ids)

    async def _prepare_each(self, submits: MemoryObjectReceiveStream[Submit]) -> None:
        async with submits:
            async for msg in submits:
                rid = msg.request_id
                prepared = None if self._preparing[rid] else await anyio.to_thread.run_sync(
                    self._prepare, msg, limiter=self._thread)
                if prepared is None or self._preparing[rid]:
                    del self._preparing[rid]                # aborted meanwhile: its reader has gone
                    continue
                if isinstance(prepared, RequestError):
                    del self._preparing[rid]
                    self._demux.deliver(Rejected.of(rid, prepared))
                    continue
                ids, detok = prepared
                self._streams[rid] = _Stream(detok, len(ids))
                await self._to_scheduler.send(Tokenized(request_id=rid, prompt_ids=ids, params=msg.params))
                if self._preparing.pop(rid) and self._streams.pop(rid, None) is not None:
                    await self._to_scheduler.send(Abort(request_id=rid))   # aborted while it was handed over

    async def _emitted(self, msg: TokensEmitted) -> None:
        stream = self._streams.get(msg.request_id)
        if stream is None:                       # ended here already: a stop string or an abort
            return
        if msg.error is not None:                # the engine failed it: whatever text was held back is lost
            del self._streams[msg.request_id]
            self._metrics.request_failed.inc()
            self._demux.deliver(TextDelta(request_id=msg.request_id, text="", num_tokens=0, error=msg.error,
                                           counts=msg.counts.merge(TokenCounts(prompt=stream.num_prompt_tokens,
                                                                               completion=stream.num_tokens))))
            return
        # A step's tokens come together; a stop string inside them ends the output at the token
        # that completes it, as if they had come one by one.
        text, taken, reason = stream.detok.advance(msg.token_ids, msg.finish_reason)
        ids = msg.token_ids[:taken]
        logprobs = msg.logprobs[:len(ids)]
        stream.num_tokens += len(ids)
        if stream.detok.stopped:
            await self._to_scheduler.send(Abort(request_id=msg.request_id, by_client=False))
        if reason is not None:
            del self._streams[msg.request_id]
            self._metrics.request_success.labels(finished_reason=reason).inc()
        self._demux.deliver(TextDelta(
            request_id=msg.request_id, text=text, num_tokens=len(ids),
            logprobs=tuple(self._logprob_info(t.token_id, t.logprob, t.top_logprobs) for t in logprobs),
            prompt_logprobs=tuple(self._prompt_info(t) for t in msg.prompt_logprobs),
            finish_reason=reason, stop_string=stream.detok.stop_reason, embedding=msg.embedding,
            counts=msg.counts.merge(TokenCounts(prompt=stream.num_prompt_tokens, completion=stream.num_tokens))))

    def _logprob_info(self, token_id: int, logprob: float | None,
                      top: tuple[tuple[int, float], ...]) -> TokenLogprobInfo:
        tok = self._tok
        return TokenLogprobInfo(
            token_id=token_id, text=tok.token_str(token_id), token_bytes=tok.token_bytes(token_id),
            logprob=logprob if logprob is not None else 0.0,
            top=tuple((tok.token_str(i), tok.token_bytes(i), lp) for i, lp in top))

    def _prompt_info(self, scored: SampledToken) -> TokenLogprobInfo:
        """A prompt token scored: its logprob (None for the first), rank and alternatives, by id and text."""
        info = self._logprob_info(scored.token_id, scored.logprob, scored.top_logprobs)
        return TokenLogprobInfo(token_id=info.token_id, text=info.text, token_bytes=info.token_bytes,
                                logprob=scored.logprob, top=info.top, rank=scored.rank,
                                top_ids=tuple(i for i, _ in scored.top_logprobs))
