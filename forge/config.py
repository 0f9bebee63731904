"""Engine configuration: one frozen record, sizes parsed from human units, checked once."""

from __future__ import annotations

import re
from dataclasses import dataclass

from forge.kernels import KERNELS, NUMERICS
from forge.sampling.reasoning import PARSERS
from forge.sampling.sampling_params import POOLING_MODES
from forge.spec_decode.speculation import SpeculativeConfig

# How the forward's matmuls use the cores (forge.models.llama.linear): "blas" hands each product whole to
# BLAS and its thread pool; "split" cuts each product's output columns over a pool of Python threads,
# each on 1-thread BLAS, whose idle threads sleep instead of spinning.
MATMUL_STRATEGIES = ("blas", "split")
# The order in which a step's token budget is handed out (forge.engine.scheduler): "shortest-first"
# (decode rows, then the prefills and prompts with the fewest tokens left, with aging) or "fcfs".
SCHEDULING_POLICIES = ("fcfs", "shortest-first")
# How the K/V cache stores values (forge.models.llama.kv_dtype); bfloat16 as the raw upper 16 bits.
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(text: str | int) -> int:
    """'1GiB', '512MiB', '2g', 1073741824 -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    # Bytes of K/V arrays (sets the number of blocks); None: sized to the model (forge.llm.plan_cache).
    kv_cache_memory: int | None = None
    max_model_len: int | None = None         # None: the model's context length
    max_num_seqs: int = 64                   # sequences running at once
    max_num_batched_tokens: int = 512        # token budget of one step (chunked prefill)
    enable_prefix_caching: bool = True
    # Threads for the forward's matmuls. Under "split", the pool's threads (None: the usable cores),
    # BLAS pinned to 1. Under "blas", the BLAS pool's threads (None: leave the BLAS default). "split"
    # is the default: on 2 cores, 2 spinning BLAS threads run 2-10x slower whenever another thread
    # (the daemon's event loop, another process) wants a core, while "split" degrades gracefully.
    blas_threads: int | None = None
    matmul_strategy: str = "split"
    # "shortest-first" lowers time to first token under load: a short prompt is not queued behind
    # long ones (a sequence that has waited forge.engine.scheduler.AGING_STEPS steps goes first anyway).
    scheduling_policy: str = "shortest-first"
    # Who holds and multiplies the weight matrices (forge.kernels.KERNELS): "auto" picks by the CPU;
    # "numpy" is the float32 reference.
    kernels: str = "auto"
    # How exactly they multiply (forge.kernels.NUMERICS): "reference" is float32 over the file's
    # values (the greedy reference tests hold); "fast" rounds the products' inputs (bfloat16 on the
    # blocks backend, int8 activations on onnxruntime's) for about twice the prefill speed.
    numerics: str = "reference"
    # How the K/V cache stores values (forge.models.llama.kv_dtype.KV_CACHE_DTYPES); attention computes in
    # float32 whatever the storage. float16 by its fidelity (docs/design.md, "The K/V cache's
    # dtype"): half float32's bytes; int8 holds 3.76x float32's tokens at a measured loss.
    kv_cache_dtype: str = "float16"
    # Write every page of the K/V arrays at start (KVCache.commit_memory): the cache's memory is
    # taken then, and no step pays its first-write page faults. `forge serve` does by default.
    kv_cache_commit: bool = False
    # While sequences decode, size a step to about this many milliseconds (forge.engine.scheduler: the
    # measured cost of recent steps decides how much prompt fits); None: the token budget alone.
    max_step_ms: float | None = None
    # Speculative decoding (forge.spec_decode.speculation): "ngram" lets decoding sequences carry up to
    # num_speculative_tokens guesses from their own prompt and output into each step, verified in
    # the same forward (the output is the same as without); only while at most
    # speculative_max_batch sequences decode. Measured to pay from 1 to 32 streams on this machine
    # (docs/benchmarks.md), so on by default.
    speculative: str = "ngram"
    num_speculative_tokens: int = 8
    speculative_max_batch: int = 32
    # The guesser of speculative="draft" (forge.spec_decode.draft_model): a GGUF file (or a catalog name) with the
    # target's vocabulary, or the target's own first draft_layers layers. Exactly one of the two.
    draft_model: str | None = None
    draft_layers: int | None = None
    # A sequence stops guessing at the first guess the draft gives less than this probability.
    draft_p_min: float = 0.75
    # How POST /v1/embeddings pools the final normed hidden states of a decoder (forge.engine.pooling):
    # "last" by default, the only token that has seen the whole input under causal attention.
    pooling: str = "last"
    # How chat reads a reasoning model's thinking section (forge.sampling.reasoning): "auto" from the chat template
    # (it writes harmony's channels: "harmony"; it mentions <think>: "deepseek_r1" when its generation prompt ends
    # inside an open section, else "qwen3"), "none" (the text is all content), or a format by name.
    reasoning_parser: str = "auto"
    # Write down every change to the prefix cache's set of blocks as a KV event (forge.engine.kv_events),
    # which the daemon publishes to routers with --kv-events.
    record_kv_events: bool = False
    # The prefix cache's disk tier (forge.engine.disk_tier): full blocks the cache forgets are kept in files
    # under this directory (None: no tier), at most kv_cache_disk_size bytes of them, and loaded back.
    kv_cache_dir: str | None = None
    kv_cache_disk_size: int = 4 * 2**30

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "kv_cache_disk_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.blas_threads is not None and self.blas_threads < 1:
            raise ValueError("blas_threads must be positive")
        if self.matmul_strategy not in MATMUL_STRATEGIES:
            raise ValueError(f"matmul_strategy must be one of {', '.join(MATMUL_STRATEGIES)}")
        if self.max_step_ms is not None and self.max_step_ms <= 0:
            raise ValueError("max_step_ms must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        SpeculativeConfig(self.speculative, self.num_speculative_tokens, max_batch=self.speculative_max_batch)
        drafts = (self.draft_model is not None) + (self.draft_layers is not None)
        if self.speculative == "draft" and drafts != 1:
            raise ValueError("speculative 'draft' needs a draft: --draft-model PATH or --draft-layers N (one of them)")
        if self.speculative != "draft" and drafts:
            raise ValueError("--draft-model and --draft-layers go with --speculative draft")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be positive")
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}")
        if self.reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise ValueError("draft_p_min must be in [0, 1)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
