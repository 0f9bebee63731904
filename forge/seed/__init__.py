"""The seed-compatible API: forge-infer's toy parts and its names, kept for parity and for tests.

A one-sequence `Model` protocol with TinyTransformer (a deterministic stand-in for a network),
the byte tokenizer, forge-infer's PagedKVCache and Scheduler (thin adapters over the daemon's
block allocator and scheduler), greedy speculative decoding for one sequence, the seed's Engine
loop and its benchmark. The serving engine does not use them: real models, tokenizers and the
batched engine live in forge.models.llama, forge.text.tokenizer and forge.llm.
"""

from forge.seed import byte_tokenizer as tokeniser
from forge.seed.paged_cache import BlockTable, CacheError, OutOfBlocks, PagedKVCache, UnknownSequence
from forge.seed.toy_engine import Engine, GenerationOutput
from forge.seed.toy_model import Model, StepLogits, TinyTransformer
from forge.seed.toy_scheduler import Scheduler, SchedulerConfig, SeqState, Sequence, StepPlan
from forge.seed.toy_speculative import SpeculationResult, SpeculativeDecoder

__all__ = ["BlockTable", "CacheError", "Engine", "GenerationOutput", "Model", "OutOfBlocks", "PagedKVCache",
           "Scheduler", "SchedulerConfig", "SeqState", "Sequence", "SpeculationResult", "SpeculativeDecoder",
           "StepLogits", "StepPlan", "TinyTransformer", "UnknownSequence", "tokeniser"]
