"""Dequantizing GGUF tensors to float32: the common llama.cpp block types here, chunk by chunk, the
rest through the gguf package.

gguf's numpy dequantizers build several full-size temporaries per tensor and took 2 s of every load of
the default model (Q4_1 and Q8_0). The same arithmetic on chunks of blocks that stay in a core's cache,
written straight into the output, gives bit-identical floats (the same float32 multiply, then add) in
a fraction of the time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

F32 = npt.NDArray[np.float32]

# Blocks per chunk: 4096 blocks of 32 values are 512 KiB of float32 output.
CHUNK_BLOCKS = 4096


def dequantize(data: npt.NDArray[Any], qtype: GGMLQuantizationType) -> npt.NDArray[Any]:
    """The tensor as floats, shaped [*rows, row_length], like gguf.quants.dequantize (which it
    calls for the types it does not handle itself). `data` is as a GGUF reader gives it: for a
    quantized type, uint8 [*rows, bytes per row]."""
    kernel = _KERNELS.get(qtype)
    if kernel is None or data.dtype != np.uint8:
        return gguf_dequantize(data, qtype)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block_bytes:
        raise ValueError(f"{qtype.name} rows of {data.shape[-1]} bytes are not whole blocks")
    blocks = data.reshape(-1, block_bytes)                                        # [nb, block_bytes]
    out = np.empty((blocks.shape[0], block_elems), dtype=np.float32)              # [nb, block_elems]
    with np.errstate(all="ignore"):  # a NaN or infinite scale gives NaN/inf values, as in gguf, quietly
        for lo in range(0, blocks.shape[0], CHUNK_BLOCKS):
            kernel(blocks[lo:lo + CHUNK_BLOCKS], out[lo:lo + CHUNK_BLOCKS])
    return out.reshape(*data.shape[:-1], data.shape[-1] // block_bytes * block_elems)


def _f16(columns: npt.NDArray[np.uint8]) -> F32:
    """[n, 2] bytes -> [n, 1] float32 (little-endian float16)."""
    return np.ascontiguousarray(columns).view(np.float16).astype(np.float32)


def _q4_0(blocks: npt.NDArray[np.uint8], out: F32) -> None:
    """18-byte blocks: d (f16), 16 bytes of 4-bit q (low nibbles first); x = d * (q - 8)."""
    d, qs = _f16(blocks[:, :2]), blocks[:, 2:]
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    out -= 8
    out *= d


def _q4_1(blocks: npt.NDArray[np.uint8], out: F32) -> None:
    """20-byte blocks: d (f16), m (f16), 16 bytes of 4-bit q (low nibbles first); x = d * q + m."""
    d, m, qs = _f16(blocks[:, :2]), _f16(blocks[:, 2:4]), blocks[:, 4:]
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    out *= d
    out += m


def _q8_0(blocks: npt.NDArray[np.uint8], out: F32) -> None:
    """34-byte blocks: d (f16), 32 int8 q; x = q * d."""
    d = _f16(blocks[:, :2])
    out[...] = blocks[:, 2:].view(np.int8)
    out *= d


_KERNELS = {GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1,
            GGMLQuantizationType.Q8_0: _q8_0}
