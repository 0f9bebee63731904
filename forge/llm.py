"""The offline engine: load a GGUF model, submit prompts, step, collect outputs.

LLMEngine runs one batching loop in the caller's thread (propose -> allocate -> build -> execute
-> apply), exactly the loop the daemon spreads over its actors. LLM.generate is the convenience
on top: prompts and sampling params in, finished completions out.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from forge.block_allocator import BlockAllocator
from forge.chat import ChatTemplate
from forge.config import EngineConfig
from forge.detokenizer import IncrementalDetokenizer
from forge.engine_core import EngineCore
from forge.errors import ConfigError, InvalidRequest
from forge.gguf_file import read_gguf
from forge.hub import resolve_model
from forge.kernels import KernelChoice, choose_kernels
from forge.llama.config import architecture_of
from forge.llama.kv_cache import KVCache
from forge.llama.linear import configure_matmul
from forge.llama.model import LlamaModel
from forge.messages import SampledToken, StepBatch, StepOutput, TokensEmitted
from forge.runner import ModelRunner
from forge.sampling_params import SamplingParams
from forge.scheduler import SchedulerConfig
from forge.structured import Grammars
from forge.tokenizer import Tokenizer

Progress = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(slots=True)
class LoadedModel:
    path: str
    model: LlamaModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    kernels: KernelChoice = field(default_factory=lambda: KernelChoice("numpy", False, "built by hand"))

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, *, kernels: str = "auto",
             numerics: str = "reference", progress: Progress = _stderr) -> LoadedModel:
        """The model, its tokenizer and chat template; its matrices held by the `kernels` backend
        (forge.kernels.KERNELS) in `numerics` (NUMERICS). Raises ConfigError for kernels that
        cannot be had here."""
        try:
            choice = choose_kernels(kernels, numerics)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        resolved = resolve_model(path, progress)
        reader = read_gguf(resolved)             # the tokenizer and the model share one read of the file
        architecture_of(reader, resolved.name)   # an unsupported family is refused before anything else
        tokenizer = Tokenizer.from_gguf(reader)
        for warning in tokenizer.warnings:
            progress(f"warning: {warning}")
        model = LlamaModel.from_reader(reader, resolved, choice)
        del reader
        _release_free_memory()
        eos = tokenizer.token_str(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None else ""
        bos = tokenizer.token_str(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
        template = ChatTemplate(tokenizer.chat_template, bos_token=bos, eos_token=eos)
        return cls(str(resolved), model, tokenizer, template, choice)

    @property
    def name(self) -> str:
        return os.path.basename(self.path).removesuffix(".gguf")


def _release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc only; elsewhere a no-op). Loading frees
    hundreds of MiB of temporaries (dequantized tensors, kernel graphs) that glibc would otherwise
    keep mapped for the daemon's whole life: measured 1.7x less resident memory afterwards."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_draft(target: LoadedModel, config: EngineConfig, progress: Progress = _stderr) -> LoadedModel | None:
    """The separate draft model of config.draft_model (None when there is none), checked to speak
    the target's vocabulary (ConfigError otherwise)."""
    if config.speculative != "draft" or config.draft_model is None:
        return None
    draft = LoadedModel.load(config.draft_model, kernels=config.kernels, numerics=config.numerics, progress=progress)
    check_draft(target, draft)
    return draft


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    reason = target.tokenizer.mismatch(draft.tokenizer)
    if reason is not None:
        raise ConfigError(f"the draft model {draft.name} does not share {target.name}'s vocabulary: {reason}")


# The default K/V budget (--kv-cache-memory unset) holds max_num_seqs sequences of this many
# tokens (a prompt and its reply, as chat and completion traffic runs), or one of the model's whole
# context if that is more ...
TYPICAL_SEQ_TOKENS = 1024
# ... and takes at most this share of the machine's memory (the smaller of its RAM and a cgroup's
# limit): the weights, the process and the rest of the host keep the other part.
KV_MEMORY_SHARE = 0.4


def machine_memory() -> int | None:
    """Bytes this process may use: MemTotal, or a smaller cgroup limit (v2 memory.max, v1
    memory.limit_in_bytes: a container's, or systemd's MemoryMax=); None where neither reads."""
    limits: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            limits += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:")]
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:                # "max", or v1's "no limit"
            limits.append(int(text))
    return min(limits) if limits else None


@dataclass(frozen=True, slots=True)
class CachePlan:
    num_blocks: int
    max_model_len: int
    budget: int                 # bytes of K/V the blocks take (num_blocks x bytes per block)
    bytes_per_token: int        # of the model (and its draft), in the cache's dtype
    sized: str                  # "model": the default budget sized to the model; "set": --kv-cache-memory
    warning: str | None = None  # why max_model_len is below the model's context, for the start-up log


def plan_cache(model: LlamaModel, config: EngineConfig, draft: LlamaModel | None = None,
               memory: int | None = None) -> CachePlan:
    """The number of blocks and max_model_len from the memory budget; one sequence of max length
    must fit. The budget is --kv-cache-memory, or unset, max_num_seqs sequences of
    TYPICAL_SEQ_TOKENS (or one whole context, if more) in the cache's dtype, at most
    KV_MEMORY_SHARE of `memory` (machine_memory() when None). Unset, max_model_len is the model's
    context, or what the budget holds if that is less (with a warning naming the cause and the
    flags); set, it must fit. A separate draft model keeps its K/V in the same blocks, from the
    same budget, and its context bounds the sequences too."""
    per_block = KVCache.bytes_per_block(model.config, config.block_size, config.kv_cache_dtype)
    context = model.config.max_position
    if draft is not None:
        per_block += KVCache.bytes_per_block(draft.config, config.block_size, config.kv_cache_dtype)
        context = min(context, draft.config.max_position)
    wanted_len = min(config.max_model_len or context, context)
    if config.kv_cache_memory is not None:
        budget, sized = config.kv_cache_memory, "set"
    else:
        tokens = max(config.max_num_seqs * TYPICAL_SEQ_TOKENS, wanted_len)
        budget, sized = -(-tokens // config.block_size) * per_block, "model"
        memory = machine_memory() if memory is None else memory
        if memory is not None:
            budget = max(per_block, min(budget, int(memory * KV_MEMORY_SHARE)))
    num_blocks = budget // per_block
    held = num_blocks * config.block_size
    max_len, warning = wanted_len, None
    if config.max_model_len is None and held >= 2 and held < wanted_len:
        max_len = held
        flag = "--kv-cache-memory"
        if sized == "model":
            flag += f" (unset: at most {KV_MEMORY_SHARE:.0%} of this machine's memory)"
        warning = (f"the KV cache holds {held} tokens ({budget / 2**20:.0f} MiB in {config.kv_cache_dtype}), less "
                   f"than the model's context of {context}: max_model_len is {held}; raise {flag}, or store "
                   f"more tokens per byte with --kv-cache-dtype int8, or set --max-model-len")
    if held < max_len:
        raise ConfigError(
            f"the KV cache budget ({budget} bytes, {held} tokens) cannot hold one sequence of max_model_len "
            f"{max_len}: raise --kv-cache-memory or lower --max-model-len")
    return CachePlan(int(num_blocks), int(max_len), int(num_blocks * per_block), per_block // config.block_size,
                     sized, warning)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                 draft: LoadedModel | None = None) -> None:
        """`draft`: the draft model of config.draft_model, if already loaded (else loaded here)."""
        configure_matmul(config.matmul_strategy, config.blas_threads)
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        if draft is None:
            draft = load_draft(loaded, config)
        else:
            check_draft(loaded, draft)
        draft_model = draft.model if draft is not None else None
        plan = plan_cache(loaded.model, config, draft_model)
        if plan.warning is not None:
            print(f"forge: warning: {plan.warning}", file=sys.stderr, flush=True)
        num_blocks, self.max_model_len = plan.num_blocks, plan.max_model_len
        self.cache = BlockAllocator(num_blocks, config.block_size,
                                  enable_prefix_caching=config.enable_prefix_caching)
        self.core = EngineCore(
            SchedulerConfig.of(config), self.cache.layout(), eos_token_id=self.tokenizer.eos_token_id,
            end_token_ids=self.tokenizer.end_token_ids,
            max_model_len=self.max_model_len,
            vocab_size=loaded.model.config.vocab_size)
        self.grammars = Grammars(self.tokenizer)
        self.runner = ModelRunner(loaded.model, num_blocks=num_blocks, block_size=config.block_size,
                                  kv_cache_dtype=config.kv_cache_dtype,
                                  eos_token_id=self.tokenizer.eos_token_id, grammars=self.grammars,
                                  end_token_ids=self.tokenizer.end_token_ids, draft_model=draft_model,
                                  draft_layers=config.draft_layers, draft_p_min=config.draft_p_min)
        if config.kv_cache_commit:
            self.runner.commit_kv_memory()
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
            self.cache.free(seq_id)
        batch = self.core.build(self.cache.allocate_step(proposal.asks, proposal.admit_budget))
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
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class LLM:
    """Prompts in, completions out. `stream` yields text as it is generated."""

    def __init__(self, model: str | os.PathLike[str] | None = None, config: EngineConfig = EngineConfig(),
                 *, progress: Progress = _stderr) -> None:
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
                text, taken = detok.push_run(ev.token_ids)
                out.token_ids.extend(ev.token_ids[:taken])
                out.logprobs.extend(ev.logprobs[:taken])
                out.num_cached_tokens = ev.num_cached_tokens
                if detok.stopped:
                    self.engine.abort(ev.request_id)
                    out.finish_reason = "stop"
                elif ev.finish_reason is not None:
                    text += detok.flush()
                    out.finish_reason = ev.finish_reason
                out.text += text
                yield ev.request_id, text
