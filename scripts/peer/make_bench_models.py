"""Write the benchmarks' bigger models: random weights in real models' shapes, quantized by the peer.

forge's real-model figures come from SmolLM2-135M; users serve 1-8B models on CPUs. No such model
is on the package registry, so this writes random-weight ones with the shapes of the sizes people
serve, the default model's tokenizer (its metadata copied), as F16 with the `gguf` package, then
quantizes them with llama.cpp's own `llama-quantize` (from the peer build, scripts/peer/peer_llama.sh):

    1.7b   SmolLM2-1.7B's shapes: hidden 2048, 24 layers, 32 heads, 32 KV heads, FFN 8192
    7b     Llama-2-7B's shapes:   hidden 4096, 32 layers, 32 heads, 32 KV heads, FFN 11008

The mixtures of experts are too big to write as F16 and quantize (Qwen3-30B-A3B: 61 GB of F16), so
their Q4_K_M file is written directly: random Q4_K and Q6_K *blocks* (random codes, scales chosen so
that each row's values have a standard deviation near 1/sqrt(in)), each tensor in the type
llama-quantize's Q4_K_M gives it (Q6_K for the output, and for attn_v and ffn_down_exps in the
layers its use_more_bits rule picks; the routers and norms float32):

    30b-a3b       Qwen3-30B-A3B's shapes (qwen3moe): hidden 2048, 48 layers, 32 heads, 4 KV heads, head 128,
                  128 experts, top 8, expert FFN 768 (~17 GiB)
    30b-a3b-12l   the same, 12 of the 48 layers (~4.4 GiB: quick runs)
    olmoe         OLMoE-1B-7B's shapes (olmoe): hidden 2048, 16 layers, 16 heads, 64 experts, top 8,
                  expert FFN 1024 (~3.9 GiB)

The vocabulary is the tokenizer's (49,152), not the real models' (151,936; 50,304): the head is
smaller, which matters little beside the experts.

    .venv/bin/python scripts/peer/make_bench_models.py 1.7b --quant Q4_K_M Q4_0 [--out DIR]
    .venv/bin/python scripts/peer/make_bench_models.py 30b-a3b-12l      # Q4_K_M only

writes DIR/bench-1.7b-Q4_K_M.gguf etc. (DIR defaults to $FORGE_HOME/bench-models) and prints their
paths; the F16 file is removed once quantized (--keep-f16 keeps it). The outputs of random weights
are noise: these models measure speed and memory, never quality. Tensors are generated and written
one at a time, so memory stays at one tensor whatever the size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from forge.models.gguf_file import read_gguf  # noqa: E402
from forge.models.hub import default_model_path, forge_home  # noqa: E402


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int = 4096


SHAPES = {"1.7b": Shape(2048, 24, 32, 32, 8192, 8192), "7b": Shape(4096, 32, 32, 32, 11008, 4096)}


@dataclass(frozen=True)
class MoeShape:
    arch: str                 # qwen3moe or olmoe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_ffn: int
    rope_theta: float
    rms_eps: float
    context: int


MOE_SHAPES = {"30b-a3b": MoeShape("qwen3moe", 2048, 48, 32, 4, 128, 128, 8, 768, 1e6, 1e-6, 40960),
              "30b-a3b-12l": MoeShape("qwen3moe", 2048, 12, 32, 4, 128, 128, 8, 768, 1e6, 1e-6, 40960),
              "olmoe": MoeShape("olmoe", 2048, 16, 16, 16, 128, 64, 8, 1024, 1e4, 1e-5, 4096)}
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def write_f16(path: Path, shape: Shape, seed: int) -> None:
    source = read_gguf(default_model_path())
    vocab = len(source.metadata["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"forge-bench-{path.stem}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    arch = "llama"
    writer.add_uint32(f"{arch}.block_count", shape.layers)
    writer.add_uint32(f"{arch}.context_length", shape.context)
    writer.add_uint32(f"{arch}.embedding_length", shape.hidden)
    writer.add_uint32(f"{arch}.feed_forward_length", shape.ffn)
    writer.add_uint32(f"{arch}.attention.head_count", shape.heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", 130000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32(f"{arch}.rope.dimension_count", shape.hidden // shape.heads)
    writer.add_uint32(f"{arch}.vocab_size", vocab)
    copy_tokenizer(writer, source.metadata)

    hd = shape.hidden // shape.heads
    tensors: list[tuple[str, tuple[int, ...], bool]] = [("token_embd.weight", (vocab, shape.hidden), True)]
    for i in range(shape.layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (shape.hidden,), False),
                    (p + "attn_q.weight", (shape.heads * hd, shape.hidden), True),
                    (p + "attn_k.weight", (shape.kv_heads * hd, shape.hidden), True),
                    (p + "attn_v.weight", (shape.kv_heads * hd, shape.hidden), True),
                    (p + "attn_output.weight", (shape.hidden, shape.heads * hd), True),
                    (p + "ffn_norm.weight", (shape.hidden,), False),
                    (p + "ffn_gate.weight", (shape.ffn, shape.hidden), True),
                    (p + "ffn_up.weight", (shape.ffn, shape.hidden), True),
                    (p + "ffn_down.weight", (shape.hidden, shape.ffn), True)]
    tensors += [("output_norm.weight", (shape.hidden,), False)]
    for name, dims, matrix in tensors:
        dtype = np.float16 if matrix else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, dims, matrix in tensors:
        if matrix:     # rows of unit norm / sqrt(in): activations keep their scale through the layers
            data = (rng.standard_normal(dims, dtype=np.float32) * np.float32(1 / np.sqrt(dims[-1]))).astype(np.float16)
        else:
            data = np.ones(dims, dtype=np.float32)
        writer.write_tensor_data(data)
        del data
    writer.close()


def copy_tokenizer(writer: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    """The default model's tokenizer (its metadata) into `writer`."""
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(int(meta["tokenizer.ggml.bos_token_id"]))
    writer.add_eos_token_id(int(meta["tokenizer.ggml.eos_token_id"]))
    writer.add_pad_token_id(int(meta["tokenizer.ggml.padding_token_id"]))
    writer.add_add_bos_token(bool(meta["tokenizer.ggml.add_bos_token"]))
    writer.add_chat_template(meta["tokenizer.chat_template"])


# ---- mixtures of experts: Q4_K_M written block by block ------------------------------------------

Q = gguf.GGMLQuantizationType


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's rule for the layers whose attn_v and ffn_down get Q6_K under Q4_K_M."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> npt.NDArray[np.uint8]:
    """[rows, cols / 256 * bytes] random Q4_K or Q6_K blocks: random codes and scales, the block's
    float16 scale(s) set so that the values have a standard deviation near 1/sqrt(cols) and a mean near 0."""
    per_row = cols // 256
    size = 144 if qtype == Q.Q4_K else 210
    raw = np.frombuffer(bytearray(rng.bytes(rows * per_row * size)), dtype=np.uint8).reshape(rows * per_row, size)
    sigma = 1.0 / np.sqrt(cols)
    if qtype == Q.Q4_K:       # w = d * sc * q - dmin * m; sc, m ~ U{0..63}, q ~ U{0..15}: dmin = 7.5 d centres it
        d = sigma / (31.5 * 4.6)
        raw[:, 0:4] = np.array([d, 7.5 * d], dtype=np.float16).view(np.uint8)
    else:                     # Q6_K: w = d * sc * (q - 32); sc ~ U{-128..127}, q ~ U{0..63}
        raw[:, 208:210] = np.array([sigma / (73.9 * 18.5)], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, per_row * size)


def write_moe(path: Path, shape: MoeShape, seed: int) -> None:
    """A mixture of experts in Q4_K_M, written directly as random blocks (see the module's docstring)."""
    source = read_gguf(default_model_path())
    vocab = len(source.metadata["tokenizer.ggml.tokens"])
    a, s = shape.arch, shape
    writer = gguf.GGUFWriter(path, a)
    writer.add_name(f"forge-bench-{path.stem}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, value in (("block_count", s.layers), ("context_length", s.context), ("embedding_length", s.hidden),
                       ("feed_forward_length", s.expert_ffn if a == "olmoe" else 6144),
                       ("attention.head_count", s.heads), ("attention.head_count_kv", s.kv_heads),
                       ("attention.key_length", s.head_dim), ("attention.value_length", s.head_dim),
                       ("expert_count", s.experts), ("expert_used_count", s.used), ("vocab_size", vocab)):
        writer.add_uint32(f"{a}.{key}", value)
    if a == "qwen3moe":
        writer.add_uint32(f"{a}.expert_feed_forward_length", s.expert_ffn)
    writer.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    copy_tokenizer(writer, source.metadata)
    writer.add_quantization_version(2)

    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim
    qk_norm = (q_rows, kv_rows) if a == "olmoe" else (s.head_dim, s.head_dim)    # OLMoE's over the whole q, k
    # (name, shape [.., rows, cols], type): F32 tensors are vectors (norms) or the routers
    tensors: list[tuple[str, tuple[int, ...], Q]] = [("token_embd.weight", (vocab, s.hidden), Q.Q4_K)]
    for i in range(s.layers):
        p, more = f"blk.{i}.", use_more_bits(i, s.layers)
        tensors += [(p + "attn_norm.weight", (s.hidden,), Q.F32),
                    (p + "attn_q.weight", (q_rows, s.hidden), Q.Q4_K),
                    (p + "attn_k.weight", (kv_rows, s.hidden), Q.Q4_K),
                    (p + "attn_v.weight", (kv_rows, s.hidden), Q.Q6_K if more else Q.Q4_K),
                    (p + "attn_output.weight", (s.hidden, q_rows), Q.Q4_K),
                    (p + "attn_q_norm.weight", (qk_norm[0],), Q.F32),
                    (p + "attn_k_norm.weight", (qk_norm[1],), Q.F32),
                    (p + "ffn_norm.weight", (s.hidden,), Q.F32),
                    (p + "ffn_gate_inp.weight", (s.experts, s.hidden), Q.F32),
                    (p + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden), Q.Q4_K),
                    (p + "ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden), Q.Q4_K),
                    (p + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn), Q.Q6_K if more else Q.Q4_K)]
    tensors += [("output_norm.weight", (s.hidden,), Q.F32), ("output.weight", (vocab, s.hidden), Q.Q6_K)]
    for name, dims, qtype in tensors:
        if qtype == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            size = GGML_QUANT_SIZES[qtype][1]
            byte_shape = (*dims[:-1], dims[-1] // 256 * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, qtype in tensors:
        if qtype != Q.F32:
            rows = int(np.prod(dims[:-1]))
            data = random_blocks(rng, rows, dims[-1], qtype).reshape(*dims[:-1], -1)
        elif name.endswith("ffn_gate_inp.weight"):           # the router: logits of a few units
            data = rng.standard_normal(dims, dtype=np.float32) * np.float32(1 / np.sqrt(dims[-1]))
        else:
            data = np.ones(dims, dtype=np.float32)
        writer.write_tensor_data(data)
        del data
    writer.close()


def llama_quantize() -> str:
    """The peer build's llama-quantize (scripts/peer/peer_llama.sh builds it when it is not there)."""
    found = os.environ.get("LLAMA_QUANTIZE")
    if found:
        return found
    script = Path(__file__).with_name("peer_llama.sh")
    return subprocess.run(["bash", str(script), "quantize"], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", choices=sorted([*SHAPES, *MOE_SHAPES]))
    parser.add_argument("--quant", nargs="+", default=["Q4_K_M"], help="llama-quantize types (Q4_K_M, Q4_0, ...)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    out = args.out or forge_home() / "bench-models"
    out.mkdir(parents=True, exist_ok=True)
    if args.size in MOE_SHAPES:                # written in Q4_K_M directly, no F16 and no llama-quantize
        target = out / f"bench-{args.size}-Q4_K_M.gguf"
        if not target.exists():
            print(f"writing {target}", file=sys.stderr)
            write_moe(target.with_suffix(".part"), MOE_SHAPES[args.size], args.seed)
            target.with_suffix(".part").rename(target)
        print(target)
        return
    f16 = out / f"bench-{args.size}-F16.gguf"
    targets = [out / f"bench-{args.size}-{q}.gguf" for q in args.quant]
    if all(t.exists() for t in targets):
        print("\n".join(map(str, targets)))
        return
    if not f16.exists():
        print(f"writing {f16}", file=sys.stderr)
        write_f16(f16.with_suffix(".part"), SHAPES[args.size], args.seed)
        f16.with_suffix(".part").rename(f16)
    quantize = llama_quantize()
    for quant, target in zip(args.quant, targets, strict=True):
        if not target.exists():
            print(f"quantizing to {quant}", file=sys.stderr)
            subprocess.run([quantize, str(f16), str(target.with_suffix(".part")), quant, "2"], check=True,
                           stdout=subprocess.DEVNULL)
            target.with_suffix(".part").rename(target)
    if not args.keep_f16:
        f16.unlink()
    print("\n".join(map(str, targets)))


if __name__ == "__main__":
    main()
