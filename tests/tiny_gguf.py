"""Writes tiny random Llama GGUF files for tests, laid out as real converted files are.

The q/k rows of every head are permuted the way GGUF conversion does it, so that RoPE in the
file's order rotates adjacent pairs; norms stay F32 and matrices take the requested type.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.quants import quantize

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 1, 2


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Row order of the original checkpoint -> GGUF order: row i + j*hd/2 of a head -> 2i + j."""
    rows, cols = w.shape
    return w.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _add_matrix(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> None:
    """w is [out, in] in numpy order; falls back to F32 when a row does not fill whole blocks."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == gguf.GGMLQuantizationType.F32 or w.shape[-1] % block:
        writer.add_tensor(name, w)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)


def _tokens(vocab: int) -> list[str]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    normal = letters + [f"Ġ{a}{b}" for a in letters for b in letters]
    # a vocabulary as large as a real one (a small model behind a real tokenizer): numbered fillers
    normal += [f"<filler{i}>" for i in range(max(0, vocab - len(SPECIAL_TOKENS) - len(normal)))]
    return SPECIAL_TOKENS + normal[: vocab - len(SPECIAL_TOKENS)]


def write_tiny_llama(
    path: str | os.PathLike[str], *, vocab: int = 64, hidden: int = 32, layers: int = 2, heads: int = 4,
    kv_heads: int = 2, ffn: int = 48, seed: int = 0, quant: str = "F32", context: int = 256,
    rope_base: float = 10000.0, tied: bool = True, arch: str = "llama", omit: tuple[str, ...] = (),
    metadata: dict[str, int] | None = None, one_row_short: tuple[str, ...] = (), readable_tokenizer: bool = False,
) -> Path:
    """A random Llama GGUF at `path` (returned as a Path). quant names a GGML type that gguf can
    write from numpy (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); norms are always F32.
    `omit` names tensors to leave out, `one_row_short` tensors to write without their last row, and
    `metadata` overrides sizes ("context_length", "block_count"...: written as uint64) whatever the
    tensors are (to test loading errors). `readable_tokenizer`: the last token is "ab", which the file's one
    merge makes, so that Tokenizer.from_gguf reads it (as `forge serve` does)."""
    path = Path(path)
    qtype = gguf.GGMLQuantizationType[quant]
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny-llama")
    overrides = metadata or {}

    def size(key: str, value: int) -> None:
        if key in overrides:
            writer.add_uint64(f"{arch}.{key}", overrides[key])
        else:
            writer.add_uint32(f"{arch}.{key}", value)

    size("block_count", layers)
    size("context_length", context)
    size("embedding_length", hidden)
    size("feed_forward_length", ffn)
    size("attention.head_count", heads)
    size("attention.head_count_kv", kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    size("rope.dimension_count", head_dim)
    size("vocab_size", vocab)
    for key in overrides.keys() - {"block_count", "context_length", "embedding_length", "feed_forward_length",
                                   "attention.head_count", "attention.head_count_kv", "rope.dimension_count",
                                   "vocab_size"}:
        writer.add_uint64(f"{arch}.{key}", overrides[key])
    tokens = _tokens(vocab)
    if readable_tokenizer:
        tokens[-1] = "ab"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
                           + [gguf.TokenType.NORMAL] * (vocab - len(SPECIAL_TOKENS)))
    writer.add_token_merges(["a b"])  # GGUF cannot store an empty array; one merge stands for "none"
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)

    def put(name: str, w: np.ndarray, *, is_norm: bool = False) -> None:
        if name in omit:
            return
        if name in one_row_short:
            w = w[:-1]
        if is_norm:
            writer.add_tensor(name, w)
        else:
            _add_matrix(writer, name, w, qtype)

    put("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", norm(), is_norm=True)
        put(p + "attn_q.weight", permute_rows(matrix(heads * head_dim, hidden), heads))
        put(p + "attn_k.weight", permute_rows(matrix(kv_heads * head_dim, hidden), kv_heads))
        put(p + "attn_v.weight", matrix(kv_heads * head_dim, hidden))
        put(p + "attn_output.weight", matrix(hidden, heads * head_dim))
        put(p + "ffn_norm.weight", norm(), is_norm=True)
        put(p + "ffn_gate.weight", matrix(ffn, hidden))
        put(p + "ffn_up.weight", matrix(ffn, hidden))
        put(p + "ffn_down.weight", matrix(hidden, ffn))
    put("output_norm.weight", norm(), is_norm=True)
    if not tied:
        put("output.weight", matrix(vocab, hidden))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_tiny(path: str | os.PathLike[str], *, seed: int) -> Any:
    """A random 2-layer model (F32, vocabulary 64, context 128) written to `path` and loaded as forge
    loads a model, with a hand-built tokenizer: the tiny file's single merge names a piece outside its
    vocabulary, so Tokenizer.from_gguf rejects it on purpose."""
    from forge.llm import LoadedModel
    from forge.models.llama import LlamaModel
    from forge.text.chat_template import ChatTemplate
    from forge.text.tokenizer import Tokenizer

    write_tiny_llama(path, vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, seed=seed, context=128)
    reader = gguf.GGUFReader(path)
    tokenizer = Tokenizer(reader.fields["tokenizer.ggml.tokens"].contents(), [],
                          token_types=reader.fields["tokenizer.ggml.token_type"].contents(),
                          bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    return LoadedModel(str(path), LlamaModel.load(path), tokenizer, ChatTemplate(None))

