"""The engine's one assembly, for the offline LLM and the daemon alike: the cache planned from
the memory budget, the block allocator, the request side (EngineCore), the model runner; and the
record of what is served (the daemon's ready line, /stats and the dashboard all read it).

The offline engine drives the parts in its own loop (forge.llm); the daemon hands each to its
actor (actors/supervisor.py).
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from forge.config import EngineConfig
from forge.engine.block_allocator import BlockAllocator
from forge.engine.block_files import fingerprint
from forge.engine.cache_plan import CachePlan, plan_cache
from forge.engine.core import EngineCore
from forge.engine.disk_tier import DiskTier
from forge.engine.model_runner import ModelRunner
from forge.engine.scheduler import SchedulerConfig
from forge.kernels import compiled
from forge.models.bert.encoder import LoadedEncoder
from forge.models.llama.linear import configure_matmul
from forge.models.loading import LoadedModel, check_draft
from forge.sampling.reasoning import detect_format
from forge.sampling.structured import Grammars
from forge.text.chat_template import ChatTemplate


@dataclass(slots=True)
class EngineParts:
    core: EngineCore            # requests, the scheduler, stop rules
    allocator: BlockAllocator   # blocks, prefix cache
    runner: ModelRunner         # the model, the K/V arrays, sampling
    plan: CachePlan
    kv_commit_s: float | None   # seconds spent committing the K/V memory at start; None: not committed
    tier: DiskTier | None = None  # the prefix cache's disk tier (--kv-cache-dir), attached to the allocator


def build_engine(loaded: LoadedModel, config: EngineConfig, draft: LoadedModel | None = None, *,
                 warn: Callable[[str], None] | None = None) -> EngineParts:
    """Every part of one engine over a loaded model (and its draft, checked to share its
    vocabulary). Raises ConfigError for a budget that cannot hold one sequence. Sets the process's
    matmul pool (config.matmul_strategy, blas_threads) and commits the K/V memory when asked.
    `warn`: where a disk tier that cannot start says why (one line; stderr by default)."""
    configure_matmul(config.matmul_strategy, config.blas_threads)
    if draft is not None:
        check_draft(loaded, draft)
    draft_model = draft.model if draft is not None else None
    plan = plan_cache(loaded.model, config, draft_model)
    for model in (loaded.model, draft_model):
        if model is not None:
            model.serve_context(plan.max_model_len)      # RoPE tables for the context served, not the file's
    tokenizer = loaded.tokenizer
    allocator = BlockAllocator(plan.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                               record_events=config.record_kv_events)
    core = EngineCore(SchedulerConfig.of(config), allocator.layout(), eos_token_id=tokenizer.eos_token_id,
                      end_token_ids=tokenizer.end_token_ids, max_model_len=plan.max_model_len,
                      vocab_size=loaded.model.config.vocab_size)
    runner = ModelRunner(loaded.model, num_blocks=plan.num_blocks, block_size=config.block_size,
                         kv_cache_dtype=config.kv_cache_dtype, eos_token_id=tokenizer.eos_token_id,
                         grammars=Grammars(tokenizer), end_token_ids=tokenizer.end_token_ids,
                         draft_model=draft_model, draft_layers=config.draft_layers, draft_p_min=config.draft_p_min)
    kv_commit_s = runner.commit_kv_memory() if config.kv_cache_commit else None
    tier = disk_tier(loaded, config, runner, warn or _stderr) if config.kv_cache_dir is not None else None
    allocator.tier = tier
    return EngineParts(core, allocator, runner, plan, kv_commit_s, tier)


def disk_tier(loaded: LoadedModel, config: EngineConfig, runner: ModelRunner,
              warn: Callable[[str], None]) -> DiskTier | None:
    """The disk tier over the runner's K/V arrays, in config.kv_cache_dir's directory for this model and
    layout; None (after one warning) where it cannot run."""
    assert config.kv_cache_dir is not None
    kv = runner.kv
    if not config.enable_prefix_caching or config.draft_model is not None or not hasattr(kv, "k"):
        warn("the K/V disk tier is off: it needs the prefix cache, and no separate draft model")
        return None
    arrays = [a for a in (kv.k, kv.v, getattr(kv, "k_scales", None), getattr(kv, "v_scales", None))
              if a is not None]
    try:
        fp = fingerprint(loaded.path, kv_dtype=config.kv_cache_dtype, numerics=loaded.kernels.numerics,
                         block_size=config.block_size,
                         arrays=[(str(a.dtype), a.shape[0], *a.shape[2:]) for a in arrays])
    except OSError as exc:
        warn(f"the K/V disk tier is off: cannot read the model file: {exc}")
        return None
    return DiskTier.open(config.kv_cache_dir, fp, config.kv_cache_disk_size, arrays, config.block_size, warn=warn)


def _stderr(message: str) -> None:
    print(f"forge: {message}", file=sys.stderr, flush=True)


class Serving(msgspec.Struct, frozen=True, kw_only=True):
    """What a daemon serves and the settings that shape its figures, fixed for its life."""
    served_model_name: str
    model: str                      # the GGUF file's path
    model_file: str
    architecture: str
    tokenizer: str
    layers: int
    weights_mib: float
    draft_weights_mib: float
    kernels: str
    numerics: str
    kernels_reason: str
    attention: str                  # "compiled" or "numpy"
    compiled_kernels: str           # the compiled kernels' build status
    kv_cache_dtype: str
    kv_blocks: int
    block_size: int
    kv_tokens: int
    kv_bytes_per_token: int
    kv_budget_mib: float
    kv_budget: str                  # "model": sized to the model; "set": --kv-cache-memory
    kv_commit_s: float | str        # "off" when not committed
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    max_step_ms: float | str        # "off" without a step-time target
    scheduling_policy: str
    prefix_caching: str
    speculative: str
    version: str
    embedding_size: int = 0         # values in a POST /v1/embeddings vector (the hidden size)
    pooling: str = "last"           # how those pool the final hidden states (--pooling)
    reasoning_parser: str = "none"  # the thinking-section format chat reads (--reasoning-parser, resolved)


def serving(loaded: LoadedModel, config: EngineConfig, parts: EngineParts, *, served_model_name: str,
            draft: LoadedModel | None = None) -> Serving:
    spec = "off" if config.speculative == "off" else f"{config.speculative}, {config.num_speculative_tokens} tokens"
    if config.draft_model is not None:
        spec += f", draft {Path(config.draft_model).name}"
    elif config.draft_layers is not None:
        spec += f", draft: the first {config.draft_layers} layers"
    plan, model = parts.plan, loaded.model
    return Serving(
        served_model_name=served_model_name, model=loaded.path, model_file=Path(loaded.path).name,
        architecture=model.config.arch.name, tokenizer=loaded.tokenizer.kind, layers=model.config.num_layers,
        weights_mib=round(model.weights.nbytes / 2**20, 1),
        draft_weights_mib=round(draft.model.weights.nbytes / 2**20, 1) if draft is not None else 0,
        kernels=loaded.kernels.name, numerics=loaded.kernels.numerics, kernels_reason=loaded.kernels.reason,
        attention="compiled" if model.compiled_ops else "numpy", compiled_kernels=compiled.status(),
        kv_cache_dtype=config.kv_cache_dtype, kv_blocks=plan.num_blocks, block_size=config.block_size,
        kv_tokens=plan.num_blocks * config.block_size, kv_bytes_per_token=plan.bytes_per_token,
        kv_budget_mib=round(plan.budget / 2**20, 1), kv_budget=plan.sized,
        kv_commit_s=round(parts.kv_commit_s, 2) if parts.kv_commit_s is not None else "off",
        max_model_len=plan.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_step_ms=config.max_step_ms if config.max_step_ms is not None else "off",
        scheduling_policy=config.scheduling_policy, prefix_caching="on" if config.enable_prefix_caching else "off",
        speculative=spec, version=_version(), embedding_size=model.config.hidden_size, pooling=config.pooling,
        reasoning_parser=reasoning_format(config.reasoning_parser, loaded.chat_template))


def reasoning_format(setting: str, template: ChatTemplate) -> str:
    """--reasoning-parser resolved for a model's chat template: "auto" reads the template
    (forge.sampling.reasoning.detect_format), any other setting stands."""
    if setting != "auto":
        return setting
    return detect_format(template.source, template.generation_prompt())


def encoder_serving(encoder: LoadedEncoder, *, served_model_name: str) -> Serving:
    """An embedding model's record: no K/V cache, no scheduling; its context is max_seq_length."""
    c = encoder.model.config
    return Serving(
        served_model_name=served_model_name, model=encoder.path, model_file=encoder.name, architecture="bert",
        tokenizer="wordpiece", layers=c.num_layers, weights_mib=round(encoder.model.nbytes / 2**20, 1),
        draft_weights_mib=0, kernels="numpy", numerics="reference", kernels_reason="an encoder: float32 numpy",
        attention="numpy", compiled_kernels=compiled.status(), kv_cache_dtype="none", kv_blocks=0,
        block_size=0, kv_tokens=0, kv_bytes_per_token=0, kv_budget_mib=0.0, kv_budget="none", kv_commit_s="off",
        max_model_len=encoder.max_seq_length, max_num_seqs=0, max_num_batched_tokens=None, max_step_ms="off",
        scheduling_policy="none", prefix_caching="off", speculative="off", version=_version(),
        embedding_size=encoder.embedding_size, pooling="mean")


def _version() -> str:
    try:
        return importlib.metadata.version("forge")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
