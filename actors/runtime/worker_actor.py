"""The model worker actor: holds the weights and K/V arrays; runs each step off the event loop.

The forward runs in a worker thread, so health checks, streams and new requests stay
responsive while numpy works. One step at a time: the runner is not thread-safe. With several
models, their workers share one `cores` limiter: one model's step runs at a time, with every
core its kernels' threads were set up for, instead of two steps splitting the cores between
twice the threads (which costs more than taking turns: the threads spin and evict each other's
caches). Waiting steps get their turn in arrival order.
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from forge.engine.model_runner import ModelRunner
from forge.messages import StepBatch, StepOutput


class ModelWorkerActor:
    def __init__(self, runner: ModelRunner, inbox: MemoryObjectReceiveStream[StepBatch],
                 outbox: MemoryObjectSendStream[StepOutput], *, cores: anyio.CapacityLimiter | None = None) -> None:
        self._runner = runner
        self._inbox = inbox
        self._outbox = outbox
        self._limiter = cores if cores is not None else anyio.CapacityLimiter(1)
        self.num_steps = 0
        self.busy_s = 0.0

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-request tables: the sampling state of each live sequence."""
        return {"worker.seqs": self._runner.num_tracked()}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with self._inbox, self._outbox:
            task_status.started()
            async for batch in self._inbox:
                out = await anyio.to_thread.run_sync(self._runner.execute, batch, limiter=self._limiter)
                self.num_steps += 1
                self.busy_s += out.elapsed_s
                await self._outbox.send(out)
