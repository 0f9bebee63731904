"""Mixtures of experts: the grouped products (forge.models.llama.mixture) against a naive per-token
reference, experts kept in the file's quantized blocks (forge.models.llama.experts) and agreeing with
their dequantized values, a step's streams grouped together as each alone, and what a file must hold
(forge.models.llama.layout): one ModelLoadError line otherwise. The families' logits against
transformers are tests/unit/test_families.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from forge.errors import ModelLoadError
from forge.kernels import choose_kernels, compiled, products
from forge.kernels.quant_linear import BlockMatrix
from forge.models.forward_batch import ForwardBatch
from forge.models.llama import LlamaModel
from forge.models.llama.experts import ExpertStack, MoeWeights
from forge.models.llama.linear import matmul_unsplit
from forge.models.llama.llama_config import MoeConfig
from forge.models.llama.llama_model import swiglu
from forge.models.llama.mixture import mixture, route
from tests import tiny_families

Q = GGMLQuantizationType
HAVE_KERNELS = compiled.library() is not None


# ---- the grouped products against one token at a time ----------------------------------------------

def naive_mixture(x: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray,
                  top_k: int, norm: bool, shared: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """In float64, token by token: softmax over every expert, the top k (renormalised when `norm`),
    each chosen expert's SwiGLU MLP weighted, plus the sigmoid-gated shared expert. router [E, H],
    gate/up [E, F, H], down [E, H, F]; shared = (gate [Fs, H], up [Fs, H], down [H, Fs], g [1, H])."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = router @ row
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:top_k]
        w = p[top] / p[top].sum() if norm else p[top]
        for e, we in zip(top, w, strict=True):
            g, u = gate[e] @ row, up[e] @ row
            out[t] += we * (down[e] @ (g / (1 + np.exp(-g)) * u))
        if shared is not None:
            sg, su, sd, gate_logit = shared
            g, u = sg @ row, su @ row
            out[t] += (sd @ (g / (1 + np.exp(-g)) * u)) / (1 + np.exp(-(gate_logit @ row)[0]))
    return out


def _stack(arrays: list[np.ndarray], qtype: GGMLQuantizationType, kernel: bool) -> tuple[ExpertStack, list[np.ndarray]]:
    """The [E, rows, cols] arrays as an ExpertStack of type qtype, and the values it holds (float64)."""
    parts = [(a, qtype) if qtype == Q.F32 else (quantize(a, qtype), qtype) for a in arrays]
    held = [a.astype(np.float64) if qtype == Q.F32 else gguf_dequantize(d, qtype).astype(np.float64)
            for a, (d, _) in zip(arrays, parts, strict=True)]
    return ExpertStack(parts, arrays[0].shape[2], kernel=kernel), held


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(1, 12), num_experts=st.integers(1, 8), k_frac=st.floats(0, 1), norm=st.booleans(),
       shared=st.booleans(), qtype=st.sampled_from([Q.F32, Q.Q8_0, Q.Q4_0]), kernel=st.booleans(),
       seed=st.integers(0, 2**16))
def test_grouped_products_equal_the_per_token_reference(num_tokens: int, num_experts: int, k_frac: float,
                                                        norm: bool, shared: bool, qtype: GGMLQuantizationType,
                                                        kernel: bool, seed: int) -> None:
    assume(HAVE_KERNELS or not kernel)
    top_k = 1 + int(k_frac * (num_experts - 1))
    hidden, ffn, shared_ffn = 64, 32, 32
    rng = np.random.default_rng(seed)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    x, router = rng.standard_normal((num_tokens, hidden)).astype(np.float32), mat(num_experts, hidden)
    probs = np.sort(router.astype(np.float64) @ x.T.astype(np.float64), axis=0)[::-1]      # [E, T]
    assume(top_k == num_experts or np.min(probs[top_k - 1] - probs[top_k]) > 1e-4)         # no near-ties
    gate_up, (gate, up) = _stack([mat(num_experts, ffn, hidden), mat(num_experts, ffn, hidden)], qtype, kernel)
    down_stack, (down,) = _stack([mat(num_experts, hidden, ffn)], qtype, kernel)
    moe = MoeWeights(router=np.ascontiguousarray(router.T), gate_up=gate_up, down=down_stack)
    parts = None
    if shared:
        parts = (mat(shared_ffn, hidden), mat(shared_ffn, hidden), mat(hidden, shared_ffn), mat(1, hidden))
        moe.shared_gate_up = np.ascontiguousarray(np.concatenate(parts[:2]).T)
        moe.shared_down, moe.shared_gate = parts[2].T, np.ascontiguousarray(parts[3].T)
    config = MoeConfig(num_experts=num_experts, num_used=top_k, expert_ffn=ffn, norm_top_k=norm)
    got = mixture(x, moe, config, matmul_unsplit, swiglu)
    want = naive_mixture(x, router, gate, up, down, top_k, norm, parts)
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, float(np.abs(want).max())), rtol=0)


def test_route_takes_the_top_k_of_the_softmax() -> None:
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], dtype=np.float32)
    ids, weights = route(logits, 2, norm_top_k=False)
    assert [sorted(r) for r in ids.tolist()] == [[1, 3], [0, 2]]
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    np.testing.assert_allclose(np.sort(weights[0]), np.sort(p[[1, 3]]), rtol=1e-6)
    _, normed = route(logits, 2, norm_top_k=True, scale=2.0)
    np.testing.assert_allclose(normed.sum(axis=1), [2.0, 2.0], rtol=1e-6)       # Mixtral's softmax of the two, x2


# ---- experts in the file's blocks ---------------------------------------------------------------------

# Byte offsets of the float16 scales in a block of each type gguf cannot quantize: random codes and
# scales make valid blocks of these.
F16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_XS: (0,)}


def _expert_data(rng: np.random.Generator, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    w = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if qtype not in F16_AT:
        return quantize(w, qtype)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // elems * nbytes), dtype=np.uint8)
    blocks = data.reshape(-1, nbytes)
    for at in F16_AT[qtype]:
        scale = (np.abs(rng.standard_normal(len(blocks))) * 0.002 + 1e-4).astype(np.float16)
        blocks[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data


def _write_moe(path: Path, qtype: GGMLQuantizationType, *, as_float32: bool) -> Path:
    """A one-layer qwen3moe of width 256 (whole K-quant blocks): 4 experts of width 256, top 2, the
    experts' three tensors of type qtype (or their float32 dequantization), the rest float32."""
    rng = np.random.default_rng(int(qtype))
    hidden, ffn, heads, kv_heads, head_dim, vocab, experts = 256, 256, 4, 2, 64, 64, 4
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", 512), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                       ("expert_count", experts), ("expert_used_count", 2), ("expert_feed_forward_length", ffn)):
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_merges(["t 1"])
    writer.add_eos_token_id(1)

    def dense(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    def experts_tensor(name: str, *shape: int) -> None:
        data = _expert_data(rng, qtype, shape)
        if as_float32:
            writer.add_tensor(name, gguf_dequantize(data, qtype).astype(np.float32))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)

    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    for norm, width in (("attn_norm", hidden), ("ffn_norm", hidden), ("attn_q_norm", head_dim),
                        ("attn_k_norm", head_dim)):
        writer.add_tensor(f"blk.0.{norm}.weight", (1 + 0.1 * rng.standard_normal(width)).astype(np.float32))
    for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
        dense(f"blk.0.attn_{proj}.weight", rows, hidden)
    dense("blk.0.attn_output.weight", hidden, heads * head_dim)
    dense("blk.0.ffn_gate_inp.weight", experts, hidden)
    experts_tensor("blk.0.ffn_gate_exps.weight", experts, ffn, hidden)
    experts_tensor("blk.0.ffn_up_exps.weight", experts, ffn, hidden)
    experts_tensor("blk.0.ffn_down_exps.weight", experts, hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    dense("output.weight", vocab, hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# The compiled products read them all (Q2_K, Q3_K and IQ4_XS too since issue 53); --kernels numpy dequantizes per step.
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q2_K, Q.Q3_K, Q.IQ4_XS],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("kernels", ["numpy", "auto", "blocks", "onnxruntime"])
def test_quantized_experts_stay_quantized_and_run_on_the_files_values(tmp_path: Path, qtype: GGMLQuantizationType,
                                                                      kernels: str) -> None:
    model = LlamaModel.load(_write_moe(tmp_path / "q.gguf", qtype, as_float32=False),
                            None if kernels == "numpy" else choose_kernels(kernels))
    twin = LlamaModel.load(_write_moe(tmp_path / "f32.gguf", qtype, as_float32=True))
    moe = model.weights.layers[0].moe
    assert moe is not None and moe.gate_up.shape == (256, 512) and moe.down.shape == (256, 256)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    assert moe.gate_up.nbytes == 4 * 512 * 256 // elems * nbytes      # the file's bytes: never widened at load
    read = int(qtype) in products.QMATMUL_TYPES
    assert moe.gate_up.is_kernel == (model.weights.kernels != "numpy" and HAVE_KERNELS and read)
    if moe.gate_up.is_kernel:      # each expert a BlockMatrix over its own rows of the file's blocks
        expert = moe.gate_up[3]
        assert isinstance(expert, BlockMatrix) and expert.types == [int(qtype), int(qtype)]
    context = [5, 9, 3, 17, 40, 2, 11, 30, 8]
    want = twin.forward_context(context)
    got = model.forward_context(context)
    np.testing.assert_allclose(got, want, atol=2e-4 * float(np.abs(want).max()), rtol=0)


# ---- a step's streams grouped together ------------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["numpy", "blocks"])
def test_streams_batched_together_get_their_own_logits(tmp_path: Path, kernels: str) -> None:
    """A prompt chunk of one sequence and the decode tokens of two others in one step: their rows share
    the experts' products, and each gets what it gets alone."""
    if kernels == "blocks" and not HAVE_KERNELS:
        pytest.skip("no compiled kernels here")
    model = LlamaModel.load(tiny_families.write_gguf("qwen3moe", tmp_path / "m.gguf", quant="Q8_0"),
                            None if kernels == "numpy" else choose_kernels(kernels))
    prompts = [[5, 9, 3, 17, 40, 2, 11], [7, 30], [12, 50, 21, 4]]
    alone = [model.forward_context(p) for p in prompts]
    kv = model.new_kv_cache(num_blocks=12, block_size=4)
    tables = np.array([[0, 1], [4, 5], [8, 9]], dtype=np.int64)
    for i, p in enumerate(prompts[1:], 1):          # the two decoding streams' earlier tokens, step by step
        for pos in range(len(p) - 1):
            model.forward(_batch([p[pos]], [pos], [int(tables[i, 0]) * 4 + pos], [pos + 1], tables[i:i + 1]), kv)
    ids = prompts[0] + [prompts[1][-1], prompts[2][-1]]
    positions = list(range(7)) + [len(prompts[1]) - 1, len(prompts[2]) - 1]
    slots = [int(tables[0, pos // 4]) * 4 + pos % 4 for pos in range(7)] + [
        int(tables[i, (len(p) - 1) // 4]) * 4 + (len(p) - 1) % 4 for i, p in enumerate(prompts[1:], 1)]
    batch = ForwardBatch(token_ids=np.array(ids), positions=np.array(positions), slot_mapping=np.array(slots),
                         query_start=np.array([0, 7, 8, 9]), context_lens=np.array([7, 2, 4]), block_tables=tables,
                         sample_indices=np.array([6, 7, 8]))
    got = model.forward(batch, kv)
    for row, want in zip(got, alone, strict=True):
        np.testing.assert_allclose(row, want, atol=1e-5 * float(np.abs(want).max()), rtol=0)


def _batch(ids: list[int], positions: list[int], slots: list[int], context: list[int],
           table: np.ndarray) -> ForwardBatch:
    return ForwardBatch(token_ids=np.array(ids), positions=np.array(positions), slot_mapping=np.array(slots),
                        query_start=np.array([0, len(ids)]), context_lens=np.array(context), block_tables=table,
                        sample_indices=np.array([len(ids) - 1]))


# ---- what the file must hold -------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, *, metadata: dict[str, int] | None = None, drop: tuple[str, ...] = (),
             tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the float32 file src with metadata keys set (uint32; 0 removes one), tensors left out
    or replaced."""
    metadata, tensors = metadata or {}, tensors or {}
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith((f"{arch}.", "tokenizer.")) and field.name not in metadata:
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for key, value in metadata.items():
        if value:
            writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, tensors.get(tensor.name, np.array(tensor.data)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


BAD_FILES: list[tuple[str, str, dict[str, Any], str]] = [
    ("qwen3moe", "no expert count", {"metadata": {"qwen3moe.expert_count": 0}},
     "metadata key 'qwen3moe.expert_count' is missing"),
    ("qwen3moe", "more experts used than there are", {"metadata": {"qwen3moe.expert_used_count": 9}},
     "each token's 9 experts (expert_used_count) are more than the 8 there are"),
    ("qwen3moe", "a sigmoid router", {"metadata": {"qwen3moe.expert_gating_func": 2}},
     "expert gating function 2 is not supported (only softmax)"),
    ("qwen3moe", "2^31 experts", {"metadata": {"qwen3moe.expert_count": 2**31}},
     "tensor 'blk.0.ffn_gate_inp.weight' has shape (8, 64), expected (2147483648, 64) from the metadata"),
    ("qwen3moe", "an expert width of 2^31", {"metadata": {"qwen3moe.expert_feed_forward_length": 2**31}},
     "tensor 'blk.0.ffn_gate_exps.weight' has shape (8, 32, 64), expected (8, 2147483648, 64)"),
    ("qwen3moe", "no up projections", {"drop": ("blk.1.ffn_up_exps.weight",)},
     "tensor 'blk.1.ffn_up_exps.weight' is missing"),
    ("mixtral", "an expert short", {"tensors": {"blk.0.ffn_down_exps.weight": np.zeros((7, 64, 32), np.float32)}},
     "tensor 'blk.0.ffn_down_exps.weight' has shape (7, 64, 32), expected (8, 64, 32)"),
    ("qwen2moe", "no shared expert", {"drop": ("blk.0.ffn_gate_inp_shexp.weight",)},
     "tensor 'blk.0.ffn_gate_inp_shexp.weight' is missing"),
    ("olmoe", "a QK-norm per head", {"tensors": {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}},
     "tensor 'blk.0.attn_q_norm.weight' has shape (16,), expected (64,)"),
]


@pytest.mark.parametrize(("family", "what", "change", "message"), BAD_FILES, ids=[b[1] for b in BAD_FILES])
def test_a_bad_mixture_is_one_line(tmp_path: Path, family: str, what: str, change: dict[str, Any],
                                   message: str) -> None:
    path = _rewrite(tiny_families.write_gguf(family, tmp_path / "m.gguf"), tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelLoadError) as info:
        LlamaModel.load(path)
    assert message in str(info.value) and "\n" not in str(info.value), what


def test_a_squeezed_shared_expert_gate_is_read(tmp_path: Path) -> None:
    """Older converters wrote qwen2moe's [1, H] shared-expert gate as [H]; llama.cpp reads both."""
    path = tiny_families.write_gguf("qwen2moe", tmp_path / "m.gguf")
    sd = tiny_families.state_dict("qwen2moe")
    squeezed = {f"blk.{i}.ffn_gate_inp_shexp.weight": sd[f"model.layers.{i}.mlp.shared_expert_gate.weight"][0]
                for i in range(2)}
    other = _rewrite(path, tmp_path / "squeezed.gguf", tensors=squeezed)
    context = [5, 9, 3, 17, 40]
    np.testing.assert_array_equal(LlamaModel.load(other).forward_context(context),
                                  LlamaModel.load(path).forward_context(context))
