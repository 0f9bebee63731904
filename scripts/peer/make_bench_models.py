"""Write the benchmarks' bigger models: random weights in real models' shapes, quantized by the peer.

forge's real-model figures come from SmolLM2-135M; users serve 1-8B models on CPUs. No such model
is on the package registry, so this writes random-weight ones with the shapes of the sizes people
serve, the default model's tokenizer (its metadata copied), as F16 with the `gguf` package, then
quantizes them with llama.cpp's own `llama-quantize` (from the peer build, scripts/peer/peer_llama.sh):

    1.7b   SmolLM2-1.7B's shapes: hidden 2048, 24 layers, 32 heads, 32 KV heads, FFN 8192
    7b     Llama-2-7B's shapes:   hidden 4096, 32 layers, 32 heads, 32 KV heads, FFN 11008

    .venv/bin/python scripts/peer/make_bench_models.py 1.7b --quant Q4_K_M Q4_0 [--out DIR]

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

import gguf
import numpy as np

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
    meta = source.metadata
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


def llama_quantize() -> str:
    """The peer build's llama-quantize (scripts/peer/peer_llama.sh builds it when it is not there)."""
    found = os.environ.get("LLAMA_QUANTIZE")
    if found:
        return found
    script = Path(__file__).with_name("peer_llama.sh")
    return subprocess.run(["bash", str(script), "quantize"], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", choices=sorted(SHAPES))
    parser.add_argument("--quant", nargs="+", default=["Q4_K_M"], help="llama-quantize types (Q4_K_M, Q4_0, ...)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-f16", action="store_true")
    args = parser.parse_args()
    out = args.out or forge_home() / "bench-models"
    out.mkdir(parents=True, exist_ok=True)
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
