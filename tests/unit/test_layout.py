"""A model file is input too: metadata that claims more than the tensors hold (a context of 2^40, an embedding a
row short, a width, layer count or feed-forward width the tensors do not have) is a one-line ModelLoadError
before anything is allocated, and the RoPE tables follow the context served, not the file's claim."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from forge.config import EngineConfig
from forge.engine.assembly import build_engine
from forge.errors import ModelLoadError
from forge.llm import LoadedModel
from forge.models.llama import LlamaModel
from forge.models.llama.llama_config import MAX_CONTEXT_LENGTH
from forge.models.llama.rope import POSITIONS_AT_LOAD, RopeTables
from forge.models.loading import LoadedModel as Loaded
from tests.tiny_gguf import load_tiny, write_tiny_llama

# (file, what the one line says)
BAD_FILES: list[tuple[str, dict[str, Any], str]] = [
    ("a context of 2^40", {"metadata": {"context_length": 2**40}}, "context_length' is 1099511627776"),
    ("a context of 1e8", {"metadata": {"context_length": 10**8}}, f"at most {MAX_CONTEXT_LENGTH}"),
    ("an embedding one row short", {"one_row_short": ("token_embd.weight",)},
     "'token_embd.weight' has shape (63, 32), expected (64, 32)"),
    ("a quantized embedding one row short", {"one_row_short": ("token_embd.weight",), "quant": "Q8_0",
                                             "hidden": 64, "heads": 8},
     "'token_embd.weight' has shape (63, 64), expected (64, 64)"),
    ("a width of 2^20", {"metadata": {"embedding_length": 2**20}}, "expected (64, 1048576)"),
    ("2^40 layers", {"metadata": {"block_count": 2**40}}, "says 1099511627776 layers (block_count)"),
    ("a feed-forward width of 2^40", {"metadata": {"feed_forward_length": 2**40}},
     "'blk.0.ffn_gate.weight' has shape (48, 32), expected (1099511627776, 32)"),
    ("2^31 heads", {"metadata": {"attention.head_count": 2**31}}, "2147483648 heads"),
    ("a head size of 2^20", {"metadata": {"attention.key_length": 2**20}}, "expected (4194304, 32)"),
    ("2^20 KV heads", {"metadata": {"attention.head_count_kv": 2**20}}, "KV heads"),
    ("a feed-forward tensor one row short", {"one_row_short": ("blk.1.ffn_up.weight",)},
     "'blk.1.ffn_up.weight' has shape (47, 32), expected (48, 32)"),
    ("2^40 experts and no expert tensors", {"metadata": {"expert_count": 2**40, "expert_used_count": 2}},
     "tensor 'blk.0.ffn_gate_inp.weight' is missing"),
]


@pytest.mark.parametrize(("kwargs", "says"), [(k, s) for _, k, s in BAD_FILES], ids=[w for w, _, _ in BAD_FILES])
def test_a_file_whose_metadata_the_tensors_do_not_bear_out_is_one_line_before_any_allocation(
        tmp_path: Path, kwargs: dict[str, Any], says: str) -> None:
    path = write_tiny_llama(tmp_path / "bad.gguf", **kwargs)
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError) as info:
            LlamaModel.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message and message.startswith("bad.gguf: ")
    assert says in message, message
    assert peak < 16 * 2**20, f"{peak / 2**20:.0f} MiB allocated before refusing the file"


def test_the_served_model_is_checked_before_its_tokenizer_is_built(tmp_path: Path) -> None:
    """LoadedModel.load (what `forge serve` runs) refuses the file on its tensors, before the tokenizer (the
    tiny file's own tokenizer would fail for another reason)."""
    path = write_tiny_llama(tmp_path / "short.gguf", one_row_short=("token_embd.weight",))
    with pytest.raises(ModelLoadError, match="'token_embd.weight' has shape"):
        Loaded.load(path, kernels="numpy", progress=lambda message: None)


def test_rope_tables_follow_the_context_served_not_the_files_claim(tmp_path: Path) -> None:
    loaded: LoadedModel = load_tiny(tmp_path / "tiny.gguf", seed=0)
    claim = write_tiny_llama(tmp_path / "long.gguf", vocab=64, context=MAX_CONTEXT_LENGTH)
    loaded.model = LlamaModel.load(claim)
    assert loaded.model.config.max_position == MAX_CONTEXT_LENGTH
    assert loaded.model.rope.num_positions == POSITIONS_AT_LOAD
    build_engine(loaded, EngineConfig(max_model_len=256, block_size=4, kv_cache_dtype="float32",
                                      kv_cache_memory=64 * 2**20, kv_cache_commit=False))
    assert loaded.model.rope.num_positions == 256


def test_rope_tables_grow_to_a_position_past_them_with_the_same_angles(tmp_path: Path) -> None:
    model = LlamaModel.load(write_tiny_llama(tmp_path / "m.gguf", context=10_000))
    tables = RopeTables(model.config)
    tables.resize(16)
    positions = np.array([3, 15, 700, 9_999], dtype=np.int64)
    grown = tables.at(positions)                                   # [4, 1, half]
    assert tables.num_positions == 9_999 + 1
    whole = RopeTables(model.config)
    whole.resize(10_000)
    np.testing.assert_array_equal(grown, whole.at(positions))
    tables.resize(20_000)                                          # never past the model's context
    assert tables.num_positions == 10_000
