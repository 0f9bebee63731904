"""The seed-compatible API: forge-infer's toy parts, kept for parity and for tests.

A one-sequence `Model` protocol with TinyTransformer (a deterministic stand-in for a network),
the byte tokeniser, greedy speculative decoding for one sequence, the seed's Engine loop and its
benchmark. The serving engine does not use them: real models, tokenizers and the batched engine
live in forge.llama, forge.tokenizer and forge.llm.
"""
