"""The K/V cache's size: how many blocks, and the longest sequence they let the engine serve."""

from __future__ import annotations

from dataclasses import dataclass

from forge.config import EngineConfig
from forge.errors import ConfigError
from forge.models.llama.kv_cache import KVCache
from forge.models.llama.llama_model import LlamaModel

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
