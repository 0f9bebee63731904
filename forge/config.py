"""Engine configuration: one frozen record, sizes parsed from human units, checked once."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    kv_cache_memory: int = 2 * 2**30         # bytes of K/V arrays; sets the number of blocks
    max_model_len: int | None = None         # None: the model's context length
    max_num_seqs: int = 64                   # sequences running at once
    max_num_batched_tokens: int = 512        # token budget of one step (chunked prefill)
    enable_prefix_caching: bool = True
    blas_threads: int | None = None          # None: leave the BLAS default

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
