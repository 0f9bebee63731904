"""Long-context RoPE (YaRN, LongRoPE) against Hugging Face transformers, and the context a scaled file is served to.

tests/data/rope_scaling_reference.json (scripts/reference/make_family_reference.py --only rope) holds the logits
transformers computes for the tiny checkpoints of tests.tiny_families.ROPE_SCALING_SPECS at every position of an
input past the original context (YaRN with the default keys on qwen3, with every optional key on llama; Phi-3's
LongRoPE), and LongRoPE's also on the first original-context tokens, where transformers takes the short factors.
forge serves LongRoPE by the context it serves instead (llama.cpp's rule): the long factors past the original
context, the short ones within it, so each regime is checked under the context that takes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from forge.config import EngineConfig
from forge.errors import ModelLoadError
from forge.kernels import choose_kernels
from forge.models.gguf_file import read_gguf
from forge.models.llama import LlamaModel
from forge.models.llama.rope_scaling import RopeScaling, yarn_mscale
from tests import tiny_families
from tests.unit.test_families import ATOL, _run

DATA = json.loads((Path(__file__).resolve().parent.parent / "data" / "rope_scaling_reference.json").read_text())
CASES = {f"{c['family']}-{c['factors']}" if "factors" in c else c["family"]: c for c in DATA["cases"]}


def test_every_case_has_a_reference() -> None:
    assert {c["family"] for c in DATA["cases"]} == set(tiny_families.ROPE_SCALING_SPECS)
    assert {c.get("factors") for c in DATA["cases"] if c["family"] == "phi3-longrope"} == {"short", "long"}
    for case in DATA["cases"]:                                           # the data is of these weights
        assert case["input_ids"] == tiny_families.input_ids(case["family"])[: len(case["input_ids"])]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("rope")
    return {family: tiny_families.write_gguf(family, tmp / f"{family}.gguf")
            for family in tiny_families.ROPE_SCALING_SPECS}


def _load(files: dict[str, Path], case: dict[str, Any], kernels: str = "numpy") -> LlamaModel:
    model = LlamaModel.load(files[case["family"]], None if kernels == "numpy" else choose_kernels(kernels))
    model.serve_context(case.get("served_context", model.config.max_position))
    return model


def _assert_matches(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, atol=ATOL * max(1.0, float(np.abs(expected).max()) / 10), rtol=0)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("kernels", ["numpy", "auto", "blocks", "onnxruntime"])
@pytest.mark.parametrize("prefill", [0, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(files: dict[str, Path], name: str, prefill: int, kernels: str) -> None:
    """The whole input in one prefill (0), and 3 tokens then one-token decode steps over the paged cache."""
    case = CASES[name]
    model = _load(files, case, kernels)
    assert model.config.rope_scaling.kind == tiny_families.ROPE_SCALING_SPECS[case["family"]].hf_extra[
        "rope_parameters"]["rope_type"]
    assert model.rope.long_factors == (case.get("factors") == "long")
    ids = case["input_ids"]
    _assert_matches(_run(model, ids, prefill or len(ids)), np.array(case["logits"], dtype=np.float32))


@pytest.mark.parametrize("name", sorted(CASES))
def test_without_the_scaling_logits_differ(files: dict[str, Path], name: str) -> None:
    """The references' scaling bites: forge serving the file's RoPE unscaled would not match them."""
    case = CASES[name]
    model = _load(files, case)
    object.__setattr__(model.config, "rope_scaling", RopeScaling())
    model.weights.rope_freqs = model.weights.rope_long = None
    unscaled = LlamaModel(model.config, model.weights)
    assert np.abs(_run(unscaled, case["input_ids"], len(case["input_ids"])) - np.array(case["logits"])).max() > 1e-2


def test_longrope_takes_its_factors_by_the_context_served(files: dict[str, Path]) -> None:
    """Long past the original context of 16, short within it; fixed per context, not per request: the short
    factors on the short input under a long context would not match transformers (which takes them)."""
    short = CASES["phi3-longrope-short"]
    model = LlamaModel.load(files["phi3-longrope"])
    assert model.config.rope_scaling.original_context == 16 and model.config.max_position == 64
    assert model.rope.long_factors                                         # the file's context: 64 > 16
    assert model.config.sliding_window == 0                                # Phi-4's converter writes 0: none
    for served, long_factors in ((16, False), (17, True), (64, True), (8, False)):
        model.serve_context(served)
        assert model.rope.long_factors is long_factors and model.rope.num_positions == served
    model.serve_context(64)
    got = _run(model, short["input_ids"], len(short["input_ids"]))
    assert np.abs(got - np.array(short["logits"])).max() > 1e-2


@pytest.mark.parametrize(("max_model_len", "long_factors"), [(16, False), (64, True), (None, True)])
def test_the_engine_serves_longrope_by_its_max_model_len(tmp_path: Path, files: dict[str, Path],
                                                        max_model_len: int | None, long_factors: bool) -> None:
    """`--max-model-len` at most the original context takes the short factors; unset, the file's context the long."""
    from forge.engine.assembly import build_engine
    from tests.tiny_gguf import load_tiny

    loaded = load_tiny(tmp_path / "tiny.gguf", seed=0)
    loaded.model = LlamaModel.load(files["phi3-longrope"])
    parts = build_engine(loaded, EngineConfig(max_model_len=max_model_len, block_size=4, kv_cache_dtype="float32",
                                              kv_cache_memory=2**20, kv_cache_commit=False))
    assert parts.plan.max_model_len == (max_model_len or 64)
    assert loaded.model.rope.long_factors is long_factors


def test_yarn_arithmetic() -> None:
    """transformers' inverse frequencies of qwen3-yarn (dims 0-3 on the ramp: one kept, two blended, the rest
    divided by 4), its mscale, and llama.cpp's ext_factor 0: plain interpolation."""
    yarn = RopeScaling("yarn", factor=4.0, original_context=32)
    inv = yarn.frequencies(10000.0, 32)
    plain = 10000.0 ** (-np.arange(16) * 2 / 32)
    assert inv[0] == 1.0 and np.allclose(inv[4:], plain[4:] / 4)
    np.testing.assert_allclose(inv[1:3], [0.42175597, 0.15811388], rtol=1e-7)
    linear = RopeScaling("yarn", factor=4.0, original_context=32, ext_factor=0.0)
    np.testing.assert_allclose(linear.frequencies(10000.0, 32), plain / 4)
    assert yarn_mscale(4.0) == pytest.approx(1.1386294) and yarn_mscale(1.0) == 1.0


def test_a_yarn_file_is_served_to_its_context_where_memory_allows(files: dict[str, Path]) -> None:
    """A 131,072-token YaRN file (as Qwen's with YaRN enabled) is served to all of it where the KV budget holds
    it, its RoPE tables sized to the context served; a smaller budget shrinks both."""
    from forge.engine.cache_plan import plan_cache

    reader = read_gguf(files["qwen3-yarn"])
    reader.metadata["qwen3.context_length"] = 131072
    model = LlamaModel.from_reader(reader, files["qwen3-yarn"])
    assert model.config.max_position == 131072 and model.config.rope_scaling.original_context == 32
    assert model.rope.num_positions == 4096                               # not sized by the file's claim at load
    plan = plan_cache(model, EngineConfig(block_size=16, max_num_seqs=1), memory=64 * 2**30)
    assert plan.max_model_len == 131072 and plan.warning is None
    model.serve_context(plan.max_model_len)
    assert model.rope.num_positions == 131072
    small = plan_cache(model, EngineConfig(block_size=16, max_num_seqs=1), memory=int(20 * 2**20 / 0.4))
    assert small.max_model_len < 131072 and small.warning is not None
    model.serve_context(small.max_model_len)
    assert model.rope.num_positions == small.max_model_len


def _rewrite(src: Path, out: Path, *, metadata: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
             tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of a GGUF file with metadata set (strings, float32, uint32 by type), tensors dropped or added."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name.startswith((f"{arch}.", "tokenizer.")) and field.name not in (metadata or {}):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for key, value in (metadata or {}).items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32 if isinstance(value, int) else \
            writer.add_float32
        add(key, value)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(("family", "change", "message"), [
    ("llama", {"metadata": {"llama.rope.scaling.type": "dynamic"}},
     r"x.gguf: RoPE scaling 'dynamic' is not supported \(only 'linear', 'yarn' and LongRoPE\)$"),
    ("llama", {"metadata": {"llama.rope.scaling.type": "longrope"}},
     r"x.gguf: RoPE scaling 'longrope' does not go with LongRoPE's factor tensors"),
    ("phi3-longrope", {"metadata": {"phi3.rope.scaling.type": "yarn"}},
     r"x.gguf: RoPE scaling 'yarn' does not go with LongRoPE's factor tensors"),
    ("phi3-longrope", {"drop": ("rope_factors_short.weight",)},
     r"x.gguf: tensor 'rope_factors_short.weight' is missing"),
    ("phi3-longrope", {"tensors": {"rope_freqs.weight": np.ones(8, np.float32)}},
     r"x.gguf: rope_freqs and LongRoPE's rope_factors_long/short together are not supported"),
    ("qwen3-yarn", {"metadata": {"qwen3.rope.scaling.yarn_log_multiplier": 0.1}},
     r"x.gguf: YaRN's yarn_log_multiplier \(DeepSeek's mscale_all_dim\) is not supported"),
    ("qwen3-yarn", {"metadata": {"qwen3.rope.scaling.factor": 0.0}},
     r"x.gguf: metadata key 'qwen3.rope.scaling.factor' must be positive, got 0.0"),
])
def test_what_forge_cannot_serve_is_refused_in_one_line(tmp_path: Path, family: str, change: dict[str, Any],
                                                        message: str) -> None:
    path = _rewrite(tiny_families.write_gguf(family, tmp_path / "src.gguf"), tmp_path / "x.gguf", **change)
    with pytest.raises(ModelLoadError, match=message) as caught:
        LlamaModel.load(path)
    assert "\n" not in str(caught.value)


def test_linear_scaling_is_kept_and_scales_positions_only(tmp_path: Path) -> None:
    """rope.scaling.type 'linear' (tests/unit/test_families.py checks it against transformers) divides positions
    by its factor: the frequencies and the magnitude are the plain ones."""
    model = LlamaModel.load(tiny_families.write_gguf("llama-linear-rope", tmp_path / "l.gguf"))
    scaling = model.config.rope_scaling
    assert (scaling.kind, scaling.factor, scaling.magnitude, model.config.rope_scale) == ("linear", 4.0, 1.0, 4.0)
    plain = LlamaModel.load(tiny_families.write_gguf("llama", tmp_path / "p.gguf"))
    np.testing.assert_allclose(model.rope.rotation[4], plain.rope.rotation[1], rtol=1e-6)
