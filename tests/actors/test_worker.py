"""The model worker actor's turns: workers sharing one `cores` limiter (several models in one daemon) never
run two steps at once, and every step still runs; workers without one do overlap. The runner here only
records who is inside `execute` (the subject is the actor's scheduling of steps, not the forward)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import anyio

from actors.runtime.worker_actor import ModelWorkerActor

STEPS = 6


class Recorder:
    """Counts the steps inside `execute` at once, across every runner sharing it."""

    def __init__(self, barrier: threading.Barrier | None = None) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.barrier = barrier


class Runner:
    def __init__(self, recorder: Recorder) -> None:
        self._rec = recorder

    def execute(self, batch: Any) -> Any:
        rec = self._rec
        with rec.lock:
            rec.inside += 1
            rec.most_inside = max(rec.most_inside, rec.inside)
        if rec.barrier is not None:
            rec.barrier.wait()        # both workers' steps inside at once, or a BrokenBarrierError
        else:
            time.sleep(0.02)          # long enough that a second step, were it let in, would overlap
        with rec.lock:
            rec.inside -= 1
        return _Out(batch)

    def num_tracked(self) -> int:
        return 0


class _Out:
    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.elapsed_s = 0.0


async def run_two(recorder: Recorder, cores: anyio.CapacityLimiter | None) -> list[list[Any]]:
    """Two workers, each sent STEPS steps at once; what each one's outbox got."""
    received: list[list[Any]] = [[], []]
    async with anyio.create_task_group() as tg:
        for w in range(2):
            to_worker, inbox = anyio.create_memory_object_stream[Any](math.inf)
            outbox, from_worker = anyio.create_memory_object_stream[Any](math.inf)
            worker = ModelWorkerActor(Runner(recorder), inbox, outbox, cores=cores)  # type: ignore[arg-type]
            await tg.start(worker.run)
            with to_worker:
                for i in range(STEPS):
                    to_worker.send_nowait((w, i))

            async def collect(w: int = w, stream: Any = from_worker) -> None:
                async with stream:
                    async for out in stream:
                        received[w].append(out.batch)

            tg.start_soon(collect)
    return received


async def test_workers_sharing_the_cores_take_turns() -> None:
    recorder = Recorder()
    with anyio.fail_after(30):
        received = await run_two(recorder, anyio.CapacityLimiter(1))
    assert received == [[(w, i) for i in range(STEPS)] for w in range(2)]     # every step, in order
    assert recorder.most_inside == 1


async def test_workers_of_their_own_overlap() -> None:
    recorder = Recorder(threading.Barrier(2, timeout=20))
    with anyio.fail_after(30):
        received = await run_two(recorder, None)
    assert received == [[(w, i) for i in range(STEPS)] for w in range(2)]
    assert recorder.most_inside == 2
