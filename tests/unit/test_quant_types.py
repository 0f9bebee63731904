"""The tensor types of the GGUF files people download: each loads, and runs on exactly the values the
gguf package dequantizes.

- Real blocks: every quantized tensor of Gemma 3 270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0), as the
  kernels hold it (integer codes, scales, offsets), equals gguf's dequantization bit for bit.
- Every type in a model: a tiny model whose matrices are all Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q2_K, Q3_K,
  IQ4_NL, IQ4_XS, MXFP4, F16 or BF16 gives the logits of its twin stored as float32 (gguf's
  dequantization of the same data), on the numpy reference and on the default kernels (which keep
  the types they support in blocks, K-quants included, and hold the others as float32: F16 and BF16
  under onnxruntime); under the blocks backend every matrix (and a 16-bit embedding) is held at the
  file's size, in both numerics.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from forge.errors import ModelLoadError
from forge.kernels import KernelChoice, choose_kernels
from forge.kernels.quant_blocks import SUPPORTED, affine_blocks
from forge.models.gguf_file import read_gguf
from forge.models.llama import LlamaModel
from forge.models.llama.dequant import dequantize
from forge.models.llama.llama_config import config_from_reader
from forge.models.llama.tensor_source import QuantEmbedding
from forge.models.llama.weight_memory import weight_bytes
from forge.models.llama.weights import load_weights

Q = GGMLQuantizationType
# Byte offsets of the float16 scales in one block of each type with no numpy quantizer in gguf.
F16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_NL: (0,),
          Q.IQ4_XS: (0,), Q.IQ2_XXS: (0,)}
# The types the compiled products read from the file since they were added (issue 53, 57).
LOW_BIT = [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]
MAX_ROWS = 1024     # of the 262,144-row embedding: enough blocks, without 700 MB of floats


def test_every_quantized_tensor_of_gemma3_is_held_exactly(gemma3_model_path: Path) -> None:
    seen = set()
    for name, tensor in read_gguf(gemma3_model_path).tensors.items():
        if tensor.tensor_type not in SUPPORTED:
            assert tensor.tensor_type == Q.F32, name
            continue
        data = tensor.data[:MAX_ROWS]
        want = gguf_dequantize(data, tensor.tensor_type)
        rows, cols = want.shape
        np.testing.assert_array_equal(affine_blocks(data, tensor.tensor_type, (rows, cols)).dequantize(), want,
                                      err_msg=name)
        np.testing.assert_array_equal(dequantize(data, tensor.tensor_type), want, err_msg=name)
        seen.add(tensor.tensor_type)
    assert seen == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0}


def _matrix_data(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype not in F16_AT:
        return quantize(w, qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // elems * nbytes), dtype=np.uint8)
    blocks = data.reshape(-1, nbytes)
    for at in F16_AT[qtype]:
        scale = (np.abs(rng.standard_normal(len(blocks))) * 0.002 + 1e-4).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    # the scales (every value is linear in them) brought to the quantized types' spread, 1 / sqrt(cols)
    factor = 1 / np.sqrt(cols) / np.sqrt(np.mean(gguf_dequantize(data, qtype).astype(np.float64) ** 2))
    for at in F16_AT[qtype]:
        scale = blocks[:, at:at + 2].copy().view(np.float16).astype(np.float64) * factor
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data


def _write(path: Path, qtype: GGMLQuantizationType, *, as_float32: bool, embedding: bool = False,
           tied: bool = False) -> Path:
    """A one-layer llama of width 256 (whole K-quant blocks), every matrix of type qtype (or its
    float32 dequantization); norms float32, the embedding too unless `embedding` (then qtype's; `tied`:
    no output.weight, the head is the embedding)."""
    rng = np.random.default_rng(int(qtype))
    hidden, ffn, heads, vocab = 256, 512, 4, 64
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", heads)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_merges(["t 1"])
    writer.add_eos_token_id(1)

    def put(name: str, rows: int, cols: int) -> None:
        data = _matrix_data(rng, qtype, rows, cols)
        if as_float32:
            writer.add_tensor(name, gguf_dequantize(data, qtype).astype(np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)

    if embedding:
        put("token_embd.weight", vocab, hidden)
    else:
        writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    for proj in ("q", "k", "v", "output"):
        put(f"blk.0.attn_{proj}.weight", hidden, hidden)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    put("blk.0.ffn_gate.weight", ffn, hidden)
    put("blk.0.ffn_up.weight", ffn, hidden)
    put("blk.0.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tied:
        put("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q5_0, *LOW_BIT, Q.F16, Q.BF16],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("kernels", ["numpy", "auto", "blocks", "onnxruntime"])
def test_a_model_of_each_type_runs_on_the_files_values(tmp_path: Path, qtype: GGMLQuantizationType,
                                                       kernels: str) -> None:
    model = LlamaModel.load(_write(tmp_path / "q.gguf", qtype, as_float32=False),
                            None if kernels == "numpy" else choose_kernels(kernels))
    twin = LlamaModel.load(_write(tmp_path / "f32.gguf", qtype, as_float32=True))
    backend = model.weights.kernels
    # The blocks backend reads every type here from the file (F16 and BF16 too); onnxruntime only
    # the integer-code ones.
    assert model.weights.is_dense == (backend == "numpy" or (backend != "blocks" and qtype not in SUPPORTED))
    if backend == "blocks":      # every tensor at the file's size: the matrices its blocks, the rest float32
        assert model.weights.nbytes == _file_bytes(tmp_path / "q.gguf")
    context = [5, 9, 3, 17, 40, 2, 11]
    want = twin.forward_context(context)
    got = model.forward_context(context)
    np.testing.assert_allclose(got, want, atol=2e-4 * float(np.abs(want).max()), rtol=0)


def _file_bytes(path: Path) -> int:
    return sum(int(t.data.nbytes) for t in read_gguf(path).tensors.values())


def _fast_kernels() -> KernelChoice | None:
    try:
        return choose_kernels("blocks", "fast")
    except ValueError:
        return None


@pytest.mark.parametrize("qtype", [*LOW_BIT, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_the_fast_numerics_read_each_type_from_its_blocks(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    """`--numerics fast` on the blocks backend: the same blocks (held at the file's size), the logits
    within the fast numerics' rounding (bfloat16 or int8 activations: up to 4e-3 of the largest here)."""
    kernels = _fast_kernels()
    if kernels is None:
        pytest.skip("no fast numerics on the blocks backend here")
    model = LlamaModel.load(_write(tmp_path / "q.gguf", qtype, as_float32=False), kernels)
    twin = LlamaModel.load(_write(tmp_path / "f32.gguf", qtype, as_float32=True))
    assert model.weights.fast and model.weights.nbytes == _file_bytes(tmp_path / "q.gguf")
    for context in ([5, 9, 3], [5, 9, 3, 17, 40, 2, 11, 30, 8, 21, 33, 4]):    # small steps and big ones
        want = twin.forward_context(context)
        np.testing.assert_allclose(model.forward_context(context), want, atol=1e-2 * float(np.abs(want).max()), rtol=0)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.IQ4_NL, Q.Q3_K], ids=lambda q: q.name)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_embedding_of_a_kept_type_stays_in_the_file(tmp_path: Path, qtype: GGMLQuantizationType,
                                                       tied: bool) -> None:
    """Under the blocks backend the token embedding keeps its type (16-bit values for F16 and BF16),
    looked up row by row, and a tied head multiplies from the same bytes: nothing widened to float32."""
    model = LlamaModel.load(_write(tmp_path / "q.gguf", qtype, as_float32=False, embedding=True, tied=tied),
                            choose_kernels("blocks"))
    twin = LlamaModel.load(_write(tmp_path / "f32.gguf", qtype, as_float32=True, embedding=True, tied=tied))
    assert isinstance(model.weights.embedding, QuantEmbedding) and model.weights.embedding.qtype == qtype
    assert model.weights.nbytes == _file_bytes(tmp_path / "q.gguf")
    context = [5, 9, 3, 17, 40, 2, 11]
    want = twin.forward_context(context)
    np.testing.assert_allclose(model.forward_context(context), want, atol=2e-4 * float(np.abs(want).max()), rtol=0)


def test_a_file_widened_past_the_memory_there_is_is_refused_before_loading(tmp_path: Path) -> None:
    """What the weights would take is known from the header: a type no backend keeps (IQ2_XXS) at four
    bytes a value, past the memory available (a bound passed in, as the loader's own reading of
    MemAvailable would be), is refused in one line naming it and the sizes, before anything is
    allocated; with the memory there, the same file loads. The numpy reference widens every
    quantized type; a file the backend keeps whole in its blocks is never refused here."""
    blocks = choose_kernels("blocks")
    path = _write(tmp_path / "iq2.gguf", Q.IQ2_XXS, as_float32=False)
    reader = read_gguf(path)
    config = config_from_reader(reader, path)
    held, widened = weight_bytes(reader, blocks)
    matrices = 4 * 256 * 256 + 3 * 512 * 256 + 64 * 256
    assert widened == {"IQ2_XXS": 4 * matrices} and held == 4 * matrices + 4 * (64 * 256 + 3 * 256)
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError) as refused:
            load_weights(reader, config, blocks, available=held // 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20                                       # nothing widened, nothing copied
    message = str(refused.value)
    assert "\n" not in message and message == (
        f"{config.name}: the weights would take {held / 2**20:.1f} MiB, more than the {held / 2**21:.1f} MiB of "
        f"memory available: --kernels blocks widens IQ2_XXS ({4 * matrices / 2**20:.1f} MiB) to float32")
    load_weights(reader, config, blocks, available=held)        # the memory there: it loads, widened

    path = _write(tmp_path / "q4.gguf", Q.Q4_0, as_float32=False)
    reader = read_gguf(path)
    config = config_from_reader(reader, path)
    held, widened = weight_bytes(reader, None)
    assert widened == {"Q4_0": 4 * matrices}
    with pytest.raises(ModelLoadError, match="--kernels numpy widens Q4_0 .* to float32; --kernels blocks keeps them"):
        load_weights(reader, config, None, available=held - 1)
    assert weight_bytes(reader, blocks)[1] == {}
    load_weights(reader, config, blocks, available=1)           # kept whole: the page cache's to evict
