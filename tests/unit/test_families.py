"""Every model family forge runs, against Hugging Face transformers on the same weights.

tests/data/tiny_families_reference.json (scripts/reference/make_family_reference.py) holds, per family, the
logits transformers computes for a tiny random checkpoint (tests/tiny_families.py) at every position
of a 20-token input. Here the same weights are written to GGUF as llama.cpp's converter lays them out
and run by forge: the whole input in one prefill, and as a short prefill followed by one-token decode
steps over the paged cache (gemma3's sliding window of 8 is crossed both ways), under the numpy
reference and the default kernels. The mixtures of experts (qwen3moe, olmoe, qwen2moe, and Mixtral as a
llama file with experts) run the same way; tests/unit/test_moe.py tests their parts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType

from forge.errors import ModelLoadError
from forge.kernels import choose_kernels, products
from forge.models.forward_batch import ForwardBatch
from forge.models.llama import LlamaModel
from tests import tiny_families

DATA = json.loads((Path(__file__).resolve().parent.parent / "data" / "tiny_families_reference.json").read_text())
CASES = {case["family"]: case for case in DATA["cases"]}
BLOCK_SIZE = 4
ATOL = 2e-4       # float32 through a few layers: measured differences are ~1e-5


def test_every_family_has_a_reference() -> None:
    from forge.models.llama.arch import ARCHITECTURES

    assert set(CASES) == set(tiny_families.SPECS)
    assert {spec.architecture for spec in tiny_families.SPECS.values()} == set(ARCHITECTURES)


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tiny_families.write_gguf(request.param, tmp_path_factory.mktemp(request.param) / "tiny.gguf")
    return request.param, path


def _reference(family: str) -> tuple[list[int], np.ndarray]:
    case = CASES[family]
    assert case["input_ids"] == tiny_families.input_ids(family)      # the data is of these weights
    return case["input_ids"], np.array(case["logits"], dtype=np.float32)


def _run(model: LlamaModel, ids: list[int], prefill: int) -> np.ndarray:
    """Logits at every position: `prefill` tokens in one step, then one token per step."""
    kv = model.new_kv_cache(num_blocks=-(-len(ids) // BLOCK_SIZE), block_size=BLOCK_SIZE)
    table = np.arange(kv.num_blocks, dtype=np.int64)[None, :]
    rows = []
    start = 0
    for stop in [prefill, *range(prefill + 1, len(ids) + 1)]:
        n = stop - start
        batch = ForwardBatch(
            token_ids=np.array(ids[start:stop], dtype=np.int64), positions=np.arange(start, stop, dtype=np.int64),
            slot_mapping=np.arange(start, stop, dtype=np.int64), query_start=np.array([0, n], dtype=np.int64),
            context_lens=np.array([stop], dtype=np.int64), block_tables=table,
            sample_indices=np.arange(n, dtype=np.int64))
        rows.append(model.forward(batch, kv))
        start = stop
    return np.concatenate(rows)


@pytest.mark.parametrize("kernels", ["numpy", "auto", "blocks", "onnxruntime"])
@pytest.mark.parametrize("prefill", [20, 3])
def test_logits_match_transformers(family: tuple[str, Path], kernels: str, prefill: int) -> None:
    name, path = family
    ids, expected = _reference(name)
    model = LlamaModel.load(path, None if kernels == "numpy" else choose_kernels(kernels))
    assert model.config.arch.name == tiny_families.SPECS[name].architecture
    got = _run(model, ids, prefill)
    np.testing.assert_allclose(got, expected, atol=ATOL * max(1.0, float(np.abs(expected).max()) / 10), rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_without_the_window_logits_differ(tmp_path: Path, name: str) -> None:
    """The reference crosses the sliding window: forge ignoring it would not match past position 8."""
    ids, expected = _reference(name)
    model = LlamaModel.load(tiny_families.write_gguf(name, tmp_path / "g.gguf"))
    assert any(model.config.is_sliding(i) for i in range(model.config.num_layers))
    object.__setattr__(model.config, "sliding_window", 10_000)   # as if every layer saw everything
    got = _run(model, ids, len(ids))
    window = tiny_families.SPECS[name].sliding_window
    np.testing.assert_allclose(got[:window], expected[:window], atol=ATOL)
    assert np.abs(got[window:] - expected[window:]).max() > 1e-2


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from tests.tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ModelLoadError, match=r"m.gguf: architecture 'mamba' is not supported \(only 'llama', "
                                             r"'qwen2', 'qwen3', 'gemma2', 'gemma3', 'phi3', 'qwen3moe', "
                                             r"'olmoe', 'qwen2moe', 'gpt-oss'\)"):
        LlamaModel.load(path)


def test_bias_on_a_family_without_biases_is_refused(tmp_path: Path) -> None:
    path = tiny_families.write_gguf("qwen2", tmp_path / "q.gguf")
    data = path.read_bytes().replace(b"qwen2", b"qwen3")                 # a qwen2 file claiming to be qwen3
    (tmp_path / "q3.gguf").write_bytes(data)
    with pytest.raises(ModelLoadError, match="attention biases are not supported for 'qwen3' files"):
        LlamaModel.load(tmp_path / "q3.gguf")


@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_blocks_run_on_the_kernels_as_on_numpy(tmp_path: Path, name: str) -> None:
    """The kernels take each family's matrices from the file's blocks (phi3's q, k and v as row
    ranges of one tensor, halves-rotating families' rows reordered): the numpy reference's logits."""
    path = tiny_families.write_gguf(name, tmp_path / "q8.gguf", quant="Q8_0")
    ids, _ = _reference(name)
    kernel = LlamaModel.load(path, choose_kernels("onnxruntime"))
    assert not kernel.weights.is_dense
    if tiny_families.SPECS[name].experts:    # the experts read from the file's blocks where the products read
        read = products.QMATMUL_TYPES          # their type (gpt-oss's MXFP4: dequantized per step until then)
        assert all(layer.moe is not None and layer.moe.gate_up.is_kernel == layer.moe.down.is_kernel
                   == (int(GGMLQuantizationType.Q8_0 if name != "gpt-oss" else GGMLQuantizationType.MXFP4) in read)
                   for layer in kernel.weights.layers)
    want = _run(LlamaModel.load(path), ids, 5)
    got = _run(kernel, ids, 5)
    np.testing.assert_allclose(got, want, atol=ATOL * max(1.0, float(np.abs(want).max()) / 10), rtol=0)


def test_gemma2_without_soft_capping_differs(tmp_path: Path) -> None:
    """The reference's caps bite: forge ignoring either one would not match."""
    ids, expected = _reference("gemma2")
    for cap in ("attn_softcap", "final_softcap"):
        model = LlamaModel.load(tiny_families.write_gguf("gemma2", tmp_path / f"{cap}.gguf"))
        assert getattr(model.config, cap) > 0
        object.__setattr__(model.config, cap, 0.0)
        assert np.abs(_run(model, ids, len(ids)) - expected).max() > 1e-2, cap


def test_rope_scaling_matters(tmp_path: Path) -> None:
    """The scaled variants' references differ from what forge computes with the scaling ignored."""
    ids, expected = _reference("llama-linear-rope")
    model = LlamaModel.load(tiny_families.write_gguf("llama-linear-rope", tmp_path / "r.gguf"))
    assert model.config.rope_scale == 4.0
    object.__setattr__(model.config, "rope_scale", 1.0)
    unscaled = LlamaModel(model.config, model.weights)
    assert np.abs(_run(unscaled, ids, len(ids)) - expected).max() > 1e-2
    ids, expected = _reference("llama-llama3-rope")
    model = LlamaModel.load(tiny_families.write_gguf("llama-llama3-rope", tmp_path / "l3.gguf"))
    factors = model.weights.rope_freqs
    assert factors is not None and factors.min() == 1.0 and factors.max() == 8.0   # all three regimes
    model.weights.rope_freqs = None
    unscaled = LlamaModel(model.config, model.weights)
    assert np.abs(_run(unscaled, ids, len(ids)) - expected).max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "qwen2moe", "mixtral"])
def test_the_routing_options_matter(tmp_path: Path, name: str) -> None:
    """The references tell each family's routing apart: forge with the top k's renormalisation
    flipped, OLMoE's QK-norm per head, or Qwen2-MoE without its shared expert would not match."""
    from dataclasses import replace

    from forge.models.llama.llama_model import head_norm_

    ids, expected = _reference(name)
    path = tiny_families.write_gguf(name, tmp_path / "m.gguf")
    model = LlamaModel.load(path)
    moe = model.config.moe
    assert moe is not None and moe.num_experts == 8 and moe.num_used == 2
    assert moe.norm_top_k == (name in ("qwen3moe", "mixtral"))
    object.__setattr__(model.config, "moe", replace(moe, norm_top_k=not moe.norm_top_k))
    assert np.abs(_run(model, ids, len(ids)) - expected).max() > 1e-2
    model = LlamaModel.load(path)
    if name == "olmoe":
        model._qk_norm = head_norm_             # q [nh, hd] weights broadcast, each head normed alone
        assert np.abs(_run(model, ids, len(ids)) - expected).max() > 1e-2
    if name == "qwen2moe":
        for layer in model.weights.layers:
            assert layer.moe is not None
            layer.moe.shared_gate_up = None
        assert np.abs(_run(model, ids, len(ids)) - expected).max() > 1e-2


def test_every_part_of_gpt_oss_matters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference tells each of gpt-oss's parts apart: forge without its attention sinks, its
    output, router or expert biases, the clamp of its SwiGLU, its window or YaRN would miss it by
    far, and with YaRN's correction range rounded to whole pairs (llama.cpp's, not the model's)
    by more than the reference test allows."""
    from dataclasses import replace

    from forge.models.llama import clamped_swiglu

    ids, expected = _reference("gpt-oss")
    path = tiny_families.write_gguf("gpt-oss", tmp_path / "g.gguf")

    def miss(model: LlamaModel) -> float:
        return float(np.abs(_run(model, ids, len(ids)) - expected).max())

    for attr in ("sinks", "wo_bias", "router_bias", "gate_up_bias", "down_bias"):
        model = LlamaModel.load(path)
        for layer in model.weights.layers:
            setattr(layer if hasattr(layer, attr) else layer.moe, attr, None)
        assert miss(model) > 0.5, attr
    model = LlamaModel.load(path)
    object.__setattr__(model.config, "sliding_window", 10_000)
    assert miss(model) > 0.5
    with monkeypatch.context() as patch:
        patch.setattr(clamped_swiglu, "LIMIT", np.float32(1e9))
        assert miss(LlamaModel.load(path)) > 0.5
    for change in ({"truncate": True}, {"kind": "none", "magnitude": 1.0}):
        model = LlamaModel.load(path)
        object.__setattr__(model.config, "rope_scaling", replace(model.config.rope_scaling, **change))
        assert miss(LlamaModel(model.config, model.weights)) > (ATOL if "truncate" in change else 0.5), change
