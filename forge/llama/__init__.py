"""The Llama-family model from a GGUF file: config, weights, paged attention and the forward.

Import LlamaModel, LlamaConfig and KVCache from here.
"""

from __future__ import annotations

from forge.llama.config import LlamaConfig
from forge.llama.kv_cache import KVCache
from forge.llama.model import LlamaModel

__all__ = ["KVCache", "LlamaConfig", "LlamaModel"]
