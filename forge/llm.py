"""The offline engine: load a GGUF model, submit prompts, step, collect outputs.

LLMEngine runs one batching loop in the caller's thread (propose -> allocate -> build -> execute
-> apply), exactly the loop the daemon spreads over its actors. LLM.generate is the convenience
on top: prompts and sampling params in, finished completions out.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from forge.config import EngineConfig
from forge.engine.assembly import build_engine
from forge.errors import InvalidRequest
from forge.messages import SampledToken, StepBatch, StepOutput, TokensEmitted
from forge.models.loading import LoadedModel, Progress, load_draft, to_stderr
from forge.sampling.sampling_params import SamplingParams
from forge.text.detokenizer import IncrementalDetokenizer

__all__ = ["LLM", "Completion", "LLMEngine", "LoadedModel"]

class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                 draft: LoadedModel | None = None) -> None:
        """`draft`: the draft model of config.draft_model, if already loaded (else loaded here)."""
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        parts = build_engine(loaded, config, draft if draft is not None else load_draft(loaded, config))
        if parts.plan.warning is not None:
            print(f"forge: warning: {parts.plan.warning}", file=sys.stderr, flush=True)
        self.core, self.allocator, self.runner = parts.core, parts.allocator, parts.runner
        self.max_model_len = parts.plan.max_model_len
        assert parts.runner.grammars is not None
        self.grammars = parts.runner.grammars
        # Called after each forward with its batch and seconds (benchmarks); None: nobody listens.
        self.on_step: Callable[[StepBatch, float], None] | None = None

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Queue a request; returns its prompt's token ids. Raises a RequestError for one that can never run
        (a constraint that does not compile included)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.grammar is not None:
            self.grammars.check(params.grammar, param="grammar")
        self.core.add_request(request_id, ids, params)
        return ids

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[TokensEmitted]:
        proposal = self.core.propose()
        for seq_id in proposal.frees:
            self.allocator.free(seq_id)
        batch = self.core.build(self.allocator.allocate_step(proposal.asks, proposal.admit_budget))
        if not batch.chunks and not batch.new_seqs and not batch.dropped:
            return self.core.apply(StepOutput(step_id=batch.step_id, sampled=()))
        t0 = time.perf_counter()
        output = self.runner.execute(batch)
        if self.on_step is not None:
            self.on_step(batch, time.perf_counter() - t0)
        return self.core.apply(output)


@dataclass(slots=True)
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[SampledToken] = field(default_factory=list)   # one per prompt token, when asked
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class LLM:
    """Prompts in, completions out. `stream` yields text as it is generated."""

    def __init__(self, model: str | os.PathLike[str] | None = None, config: EngineConfig = EngineConfig(),
                 *, progress: Progress = to_stderr) -> None:
        self.loaded = LoadedModel.load(model, kernels=config.kernels, numerics=config.numerics, progress=progress)
        self.engine = LLMEngine(self.loaded, config)
        self.tokenizer = self.loaded.tokenizer

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                    draft: LoadedModel | None = None) -> LLM:
        """An LLM over a model already loaded (several engines, one copy of the weights)."""
        llm = cls.__new__(cls)
        llm.loaded, llm.engine, llm.tokenizer = loaded, LLMEngine(loaded, config, draft), loaded.tokenizer
        return llm

    def chat_prompt(self, messages: list[dict[str, object]]) -> str:
        return self.loaded.chat_template.render(messages, add_generation_prompt=True)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[Completion]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest("one SamplingParams per prompt, or one for all", param="params")
        completions: dict[str, Completion] = {}
        for _ in self._run(prompts, params, completions):
            pass
        return [completions[f"gen-{i}"] for i in range(len(prompts))]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[str]:
        completions: dict[str, Completion] = {}
        yield from (text for _, text in self._run([prompt], [params], completions) if text)

    def _run(self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams],
             completions: dict[str, Completion]) -> Iterator[tuple[str, str]]:
        detoks: dict[str, IncrementalDetokenizer] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            rid = f"gen-{i}"
            ids = self.engine.add_request(rid, prompt, p)
            completions[rid] = Completion(rid, ids)
            detoks[rid] = IncrementalDetokenizer(self.tokenizer, stop=p.stop,
                                                 skip_special_tokens=p.skip_special_tokens,
                                                 prompt_ids=ids)
        while self.engine.has_work():
            for ev in self.engine.step():
                out, detok = completions[ev.request_id], detoks[ev.request_id]
                if out.finish_reason is not None:
                    continue
                text, taken, out.finish_reason = detok.advance(ev.token_ids, ev.finish_reason)
                out.token_ids.extend(ev.token_ids[:taken])
                out.logprobs.extend(ev.logprobs[:taken])
                out.prompt_logprobs.extend(ev.prompt_logprobs)
                out.num_cached_tokens = ev.counts.cached
                if detok.stopped:
                    self.engine.abort(ev.request_id)
                out.text += text
                yield ev.request_id, text
