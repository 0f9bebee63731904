"""The scheduler actor with real channels, a real allocator and a real model worker (tiny GGUF)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anyio
import pytest

from actors.ops.metrics import Metrics
from actors.runtime.allocator_actor import AllocatorActor
from actors.runtime.scheduler_actor import SchedulerActor
from actors.runtime.worker_actor import ModelWorkerActor
from forge.engine.block_allocator import BlockAllocator
from forge.engine.core import EngineCore
from forge.engine.model_runner import ModelRunner
from forge.engine.scheduler import SchedulerConfig
from forge.messages import Abort, Accepted, Rejected, Tokenized, TokensEmitted
from forge.models.llama.llama_model import LlamaModel
from forge.sampling.sampling_params import SamplingParams
from tests.tiny_gguf import EOS_ID, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    return LlamaModel.load(write_tiny_llama(Path(tmp_path_factory.mktemp("m")) / "tiny.gguf"))


async def drive(model: LlamaModel, inbox_messages: list[Any], num_expected: int) -> tuple[list[Any], BlockAllocator]:
    """Run scheduler + allocator + worker; feed messages; collect what reaches the tokenizer.

    Once the scheduler has no work left, every per-request table of the three actors is empty.
    """
    cache = BlockAllocator(32, 4, enable_prefix_caching=True)
    core = EngineCore(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, policy="shortest-first"),
                      cache.layout(), eos_token_id=EOS_ID,
                      max_model_len=64, vocab_size=model.config.vocab_size)
    runner = ModelRunner(model, num_blocks=32, block_size=4, eos_token_id=EOS_ID)
    to_sched, sched_in = anyio.create_memory_object_stream[Any](math.inf)
    to_alloc, alloc_in = anyio.create_memory_object_stream[Any](1)
    alloc_out, from_alloc = anyio.create_memory_object_stream[Any](1)
    to_worker, worker_in = anyio.create_memory_object_stream[Any](1)
    worker_out, from_worker = anyio.create_memory_object_stream[Any](1)
    to_tok, tok_in = anyio.create_memory_object_stream[Any](math.inf)
    scheduler = SchedulerActor(core, Metrics().model("test"), inbox=sched_in, to_allocator=to_alloc,
                               from_allocator=from_alloc, to_worker=to_worker, from_worker=from_worker,
                               to_tokenizer=to_tok)
    allocator = AllocatorActor(cache, alloc_in, alloc_out)
    worker = ModelWorkerActor(runner, worker_in, worker_out)
    received: list[Any] = []
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(allocator.run)
            await tg.start(worker.run)
            await tg.start(scheduler.run)
            for msg in inbox_messages:
                await to_sched.send(msg)
            async with tok_in:
                while len(received) < num_expected:
                    received.append(await tok_in.receive())
                while core.has_work():
                    await anyio.sleep(0.01)
            await to_sched.aclose()             # the scheduler ends; its ends close the others
    tables = {**scheduler.tracked(), **allocator.tracked(), **worker.tracked()}
    assert set(tables.values()) == {0}, tables
    return received, cache


async def test_requests_run_to_the_end_and_give_back_every_block(tiny: LlamaModel) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    msgs = [Tokenized(request_id=f"r{i}", prompt_ids=tuple(range(3, 10 + i)), params=params) for i in range(3)]
    received, cache = await drive(tiny, msgs, 3 + 3 * 5)
    assert sum(isinstance(m, Accepted) for m in received) == 3
    finished = [m for m in received if isinstance(m, TokensEmitted) and m.finish_reason == "length"]
    assert sorted(m.request_id for m in finished) == ["r0", "r1", "r2"]
    assert cache.free_blocks() == cache.total_blocks()


async def test_an_abort_behind_its_request_drops_it_without_an_answer(tiny: LlamaModel) -> None:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    msgs = [Tokenized(request_id="gone", prompt_ids=(3, 4, 5), params=params), Abort(request_id="gone"),
            Abort(request_id="never-seen"),                     # an abort of an ended request is a no-op
            Tokenized(request_id="ok", prompt_ids=(3, 4), params=SamplingParams(max_tokens=2, ignore_eos=True))]
    received, cache = await drive(tiny, msgs, 2 + 2)
    assert received[:2] == [Accepted(request_id="gone", num_prompt_tokens=3),
                            Accepted(request_id="ok", num_prompt_tokens=2)]
    assert [m.request_id for m in received[2:]] == ["ok", "ok"]  # nothing of "gone" comes back
    assert cache.free_blocks() == cache.total_blocks()


async def test_a_prompt_too_long_is_rejected_not_fatal(tiny: LlamaModel) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0)
    msgs = [Tokenized(request_id="long", prompt_ids=tuple([3] * 80), params=params),
            Tokenized(request_id="ok", prompt_ids=(3, 4), params=params)]
    received, _ = await drive(tiny, msgs, 2)
    assert isinstance(received[0], Rejected) and received[0].code == "context_length_exceeded"
    assert received[1] == Accepted(request_id="ok", num_prompt_tokens=2)
