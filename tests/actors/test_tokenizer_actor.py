"""The tokenizer actor with real channels, the real tokenizer and a real router.

It is the one way in and out of the engine for a request: Submit and Abort pass through it in
order, a stop string ends a request here (and tells the scheduler), and a reader that stops
reading never holds it up.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.ops.metrics import Metrics
from actors.runtime.stream_demux import StreamDemux
from actors.runtime.tokenizer_actor import TokenizerActor
from forge.messages import (
    Abort,
    Accepted,
    Rejected,
    SampledToken,
    Submit,
    TextDelta,
    Tokenized,
    TokensEmitted,
)
from forge.sampling.sampling_params import SamplingParams
from forge.text.chat_template import ChatTemplate
from forge.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path)


@dataclass
class Rig:
    actor: TokenizerActor
    demux: StreamDemux
    inbox: MemoryObjectSendStream[Any]
    to_scheduler: MemoryObjectReceiveStream[Any]

    def scheduler_got(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self.to_scheduler.receive_nowait())
            except anyio.WouldBlock:
                return out

    async def settle(self) -> None:
        """Until the actor has taken everything sent so far (its inbox is unbounded) and handed on every
        request it was preparing (in its own thread)."""
        await anyio.sleep(0)                # a message handed straight to the waiting actor is in no buffer
        while self.inbox.statistics().current_buffer_used or self.actor.tracked()["tokenizer.preparing"]:
            await anyio.sleep(0.001)
        await anyio.sleep(0)

    async def submit(self, msg: Submit) -> None:
        """Send a Submit and wait until the actor has prepared it (as the scheduler only ever hears of a
        request's tokens after its Tokenized)."""
        await self.inbox.send(msg)
        await self.settle()


@asynccontextmanager
async def running(tokenizer: Tokenizer, *, max_model_len: int | None = None) -> AsyncIterator[Rig]:
    """The actor in its own task group (entered in the test's own task: none may straddle a fixture)."""
    inbox, actor_in = anyio.create_memory_object_stream[Any](math.inf)
    actor_out, to_scheduler = anyio.create_memory_object_stream[Any](math.inf)
    demux = StreamDemux()
    actor = TokenizerActor(tokenizer, ChatTemplate(None), demux, Metrics().model("test"), inbox=actor_in,
                           to_scheduler=actor_out, max_model_len=max_model_len)
    with anyio.fail_after(10), to_scheduler:
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            yield Rig(actor, demux, inbox, to_scheduler)
            await inbox.aclose()


def ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False))


async def test_a_stop_string_ends_the_request_here_and_tells_the_scheduler(tokenizer: Tokenizer) -> None:
    async with running(tokenizer) as rig:
        group = rig.demux.open(["r"])
        await rig.submit(Submit(request_id="r", params=SamplingParams(stop=("Paris",)), text="The capital is"))
        await rig.inbox.send(Accepted(request_id="r", num_prompt_tokens=3))
        for tok in ids(tokenizer, " Paris, of course"):
            await rig.inbox.send(TokensEmitted(request_id="r", token_ids=(tok,)))
        await rig.settle()
        got = rig.scheduler_got()
        assert [type(m) for m in got] == [Tokenized, Abort] and got[1].request_id == "r"
        assert await group.wait_statuses() == [Accepted(request_id="r", num_prompt_tokens=3)]
        [(_, delta)] = await group.next_deltas()
        assert delta.finish_reason == "stop" and "Paris" not in delta.text
        assert delta.stop_string == "Paris"                    # which stop string ended it
        assert not group.unfinished and set(rig.actor.tracked().values()) == {0}


async def test_a_stop_string_inside_one_steps_tokens_ends_the_output_at_the_token_that_completes_it(
        tokenizer: Tokenizer) -> None:
    """A speculative step hands over several tokens at once: the output (text, token count and
    logprobs) is what it would be had they come one by one."""
    async with running(tokenizer) as rig:
        group = rig.demux.open(["r"])
        params = SamplingParams(stop=("Paris",), logprobs=0)
        await rig.submit(Submit(request_id="r", params=params, text="The capital is"))
        await rig.inbox.send(Accepted(request_id="r", num_prompt_tokens=3))
        run = ids(tokenizer, " Paris, of course")
        assert len(run) > 2
        await rig.inbox.send(TokensEmitted(request_id="r", token_ids=run,
                                           logprobs=tuple(SampledToken(0, t, -0.5) for t in run)))
        await rig.settle()
        [(_, delta)] = await group.next_deltas()
        assert delta.finish_reason == "stop" and delta.text == " "
        assert delta.num_tokens == delta.counts.completion == 1 == len(delta.logprobs)
        assert [type(m) for m in rig.scheduler_got()] == [Tokenized, Abort]


async def test_an_abort_follows_its_submit_and_is_forwarded_once(tokenizer: Tokenizer) -> None:
    async with running(tokenizer) as rig:
        group = rig.demux.open(["a"])
        await rig.submit(Submit(request_id="a", params=SamplingParams(), text="Hello"))
        await rig.inbox.send(Abort(request_id="a"))
        await rig.inbox.send(Abort(request_id="a"))              # a second abort: the request already ended
        await rig.inbox.send(Abort(request_id="never-submitted"))
        await rig.inbox.send(TokensEmitted(request_id="a", token_ids=ids(tokenizer, " world")))  # in flight
        await rig.settle()
        assert [(type(m), m.request_id) for m in rig.scheduler_got()] == [(Tokenized, "a"), (Abort, "a")]
        rig.demux.close(group)
        assert set(rig.actor.tracked().values()) == {0} and len(rig.demux) == 0


async def test_a_prompt_that_cannot_be_encoded_is_rejected_before_the_scheduler(tokenizer: Tokenizer) -> None:
    async with running(tokenizer) as rig:
        group = rig.demux.open(["bad"])
        await rig.inbox.send(Submit(request_id="bad", params=SamplingParams(), token_ids=(1, 10**9)))
        [status] = await group.wait_statuses()
        assert isinstance(status, Rejected) and status.status == 400 and status.param == "prompt"
        await rig.settle()
        assert rig.scheduler_got() == [] and set(rig.actor.tracked().values()) == {0}


async def test_a_stalled_reader_never_holds_up_the_actor_and_reads_one_merged_delta(
        tokenizer: Tokenizer) -> None:
    async with running(tokenizer) as rig:
        group = rig.demux.open(["slow", "fast"])
        for rid in ("slow", "fast"):
            await rig.submit(Submit(request_id=rid, params=SamplingParams(max_tokens=500), text="Count"))
            await rig.inbox.send(Accepted(request_id=rid, num_prompt_tokens=1))
        words = ids(tokenizer, " one two three four five six seven eight nine ten" * 20)
        for i, tok in enumerate(words):                         # nobody reads while all of this goes in
            last = i == len(words) - 1
            for rid in ("slow", "fast"):
                await rig.inbox.send(TokensEmitted(request_id=rid, token_ids=(tok,),
                                                   finish_reason="length" if last else None))
        await rig.settle()                                      # the actor took every message
        assert set(rig.actor.tracked().values()) == {0}
        merged = dict(await group.next_deltas())
        assert set(merged) == {0, 1}
        for delta in merged.values():
            assert isinstance(delta, TextDelta) and delta.num_tokens == len(words)
            assert delta.text == tokenizer.decode(list(words)) and delta.finish_reason == "length"
            assert delta.counts.completion == len(words)
        assert not group.unfinished


async def test_a_request_aborted_while_it_is_prepared_never_reaches_the_scheduler(tokenizer: Tokenizer) -> None:
    async with running(tokenizer) as rig:
        group = rig.demux.open(["a"])
        async with rig.actor._thread:                          # the preparing thread is busy meanwhile
            await rig.inbox.send(Submit(request_id="a", params=SamplingParams(), text="Hello"))
            await anyio.sleep(0)
            assert rig.actor.tracked()["tokenizer.preparing"] == 1
            await rig.inbox.send(Abort(request_id="a"))
            await anyio.sleep(0)
        await rig.settle()
        assert rig.scheduler_got() == []
        rig.demux.close(group)
        assert set(rig.actor.tracked().values()) == {0} and len(rig.demux) == 0


async def test_other_streams_flow_while_a_prompt_is_prepared(tokenizer: Tokenizer) -> None:
    """Preparing a request (template, encoding, stop strings) holds up neither the actor nor the text
    of the requests already running."""
    async with running(tokenizer) as rig:
        group = rig.demux.open(["running", "big"])
        await rig.submit(Submit(request_id="running", params=SamplingParams(), text="Count"))
        await rig.inbox.send(Accepted(request_id="running", num_prompt_tokens=1))
        async with rig.actor._thread:                          # "big" is being prepared all along
            await rig.inbox.send(Submit(request_id="big", params=SamplingParams(), text="1" * 100_000))
            for tok in ids(tokenizer, " one two"):
                await rig.inbox.send(TokensEmitted(request_id="running", token_ids=(tok,)))
            text = ""
            while text != " one two":
                [(index, delta)] = await group.next_deltas()
                assert index == 0 and isinstance(delta, TextDelta)
                text += delta.text
            assert rig.actor.tracked()["tokenizer.preparing"] == 1
        await rig.settle()
        assert [m.request_id for m in rig.scheduler_got()] == ["running", "big"]


async def test_a_prompt_its_size_shows_too_long_is_refused_without_encoding_it(tokenizer: Tokenizer) -> None:
    """A megabyte of digits (a token each) against a 1,024-token context: refused from its byte count."""
    async with running(tokenizer, max_model_len=1024) as rig:
        group = rig.demux.open(["big"])
        await rig.inbox.send(Submit(request_id="big", params=SamplingParams(), text="1" * 2**20))
        await rig.inbox.send(Submit(request_id="fits", params=SamplingParams(), text="1" * 1000))
        [status] = await group.wait_statuses()
        assert isinstance(status, Rejected) and status.status == 400
        assert status.code == "context_length_exceeded" and "at least" in status.message
        await rig.settle()
        assert [m.request_id for m in rig.scheduler_got()] == ["fits"]
