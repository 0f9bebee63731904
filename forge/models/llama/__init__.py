"""The Llama-family model from a GGUF file: config, weights, paged attention and the forward.

Import LlamaModel, LlamaConfig and KVCache from here.
"""

from __future__ import annotations

from forge.models.llama.kv_cache import KVCache
from forge.models.llama.llama_config import LlamaConfig
from forge.models.llama.llama_model import LlamaModel

__all__ = ["KVCache", "LlamaConfig", "LlamaModel"]
