"""forge's block dequantizers give the gguf package's floats bit for bit: random blocks (scales of every
kind, including subnormal, infinite and NaN float16 values) and every tensor of the default model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from forge.models.gguf_file import read_gguf
from forge.models.llama import dequant
from forge.models.llama.dequant import dequantize

TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 7])
def test_random_blocks_match_the_gguf_package(qtype: GGMLQuantizationType, rows: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dequant, "CHUNK_BLOCKS", 5)             # several chunks, the last one short
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    blocks_per_row = 3
    data = rng.integers(0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8)
    scales = np.array([1.0, -0.5, 6e-8, 65504.0, np.inf, np.nan, 0.0], dtype=np.float16).view(np.uint8)
    blocks = data.reshape(-1, block_bytes)
    for i in range(min(len(blocks), 7)):                         # d (and m) of the first blocks: odd values
        blocks[i, 0:2] = scales[2 * i:2 * i + 2]
    got = dequantize(data, qtype)
    with np.errstate(all="ignore"):
        want = gguf_dequantize(data, qtype)
    assert got.shape == want.shape == (rows, blocks_per_row * block_elems) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)                     # NaNs in the same places


def test_other_types_go_to_the_gguf_package() -> None:
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(dequantize(data, GGMLQuantizationType.F32), data)


def test_every_tensor_of_the_default_model_matches_the_gguf_package(default_model_path: Path) -> None:
    for tensor in read_gguf(default_model_path).tensors.values():
        np.testing.assert_array_equal(dequantize(tensor.data, tensor.tensor_type),
                                      gguf_dequantize(tensor.data, tensor.tensor_type), err_msg=tensor.name)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K])
def test_checking_blocks_accepts_what_decoding_them_does(qtype: GGMLQuantizationType) -> None:
    """check_blocks (a load's check of a matrix it keeps in its blocks) refuses exactly what affine_blocks would,
    without decoding anything."""
    from forge.kernels.quant_blocks import affine_blocks, check_blocks

    elems, nbytes = GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * elems
    data = np.zeros((rows, 2 * nbytes), np.uint8)
    check_blocks(data, qtype, (rows, cols))
    affine_blocks(data, qtype, (rows, cols))
    for shape in [(rows, cols - elems), (rows + 1, cols), (rows, cols + 1)]:
        for check in (check_blocks, affine_blocks):
            with pytest.raises(ValueError):
                check(data, qtype, shape)
    for check in (check_blocks, affine_blocks):
        with pytest.raises(ValueError):
            check(data, GGMLQuantizationType.F16, (rows, cols))
