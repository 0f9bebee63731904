"""The seed's engine: continuous batching over a one-sequence `Model` (TinyTransformer and kin).

Each step asks the scheduler for a plan and runs the model once per sequence that yields a token.
It is the reference loop the real engine (forge.llm) follows with batched forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge.engine.sequence import Sequence, TokenId
from forge.errors import EngineError
from forge.seed.paged_cache import PagedKVCache
from forge.seed.toy_model import Model
from forge.seed.toy_scheduler import Scheduler, SchedulerConfig

MAX_ITERATIONS = 1_000_000


@dataclass(slots=True)
class GenerationOutput:
    id: int
    tokens: list[TokenId]


class Engine:
    def __init__(self, model: Model, config: SchedulerConfig, cache: PagedKVCache) -> None:
        self.model = model
        self.scheduler = Scheduler(config, cache)
        self._outputs: dict[int, list[TokenId]] = {}

    def submit(self, id: int, prompt: list[TokenId], max_new_tokens: int) -> None:
        self.scheduler.submit(Sequence(id, prompt, max_new_tokens))
        self._outputs[id] = []

    def step(self) -> list[tuple[int, TokenId, bool]]:
        """Run one iteration; return (id, token, is_eos) for every token produced."""
        plan = self.scheduler.schedule()
        emitted = []
        eos = self.model.eos_token
        for seq_id in plan.decode_batch:
            seq = self.scheduler.running_seq(seq_id)
            assert seq is not None
            token = self.model.forward(seq.prompt + seq.output).argmax()
            is_eos = token == eos
            self.scheduler.push_token(seq_id, token, is_eos)
            self._outputs[seq_id].append(token)
            emitted.append((seq_id, token, is_eos))
        return emitted

    def run_to_completion(self) -> list[GenerationOutput]:
        """Drive until idle; outputs sorted by id. Raises EngineError rather than hang."""
        for _ in range(MAX_ITERATIONS):
            if not self.scheduler.has_work():
                break
            self.step()
        else:
            raise EngineError(f"engine did not finish within {MAX_ITERATIONS} iterations")
        done = sorted(self._outputs.items())
        self._outputs = {}
        return [GenerationOutput(id, tokens) for id, tokens in done]
