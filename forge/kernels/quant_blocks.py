"""GGUF block formats as affine integer codes: every value is w = scale[block] * q + offset[block].

The matmul kernels read weights in this one form whatever the file's type: q an unsigned integer
code (0 <= q < 2**bits), one float32 scale and offset per block of `block_size` values along a
row. It is exact for the types here (the same q and the same float16 scales as the file), and
dequantize() is the numpy reference every kernel is tested against.

    type   bits  block   w                          scale     offset
    Q4_0     4    32     d * (q - 8)                 d         -8 d
    Q4_1     4    32     d * q + m                   d          m
    Q5_0     5    32     d * (q - 16)                d        -16 d
    Q5_1     5    32     d * q + m                   d          m
    Q8_0     8    32     d * (q - 128)               d       -128 d     (q = the int8 + 128)
    Q4_K     4    32     d sc q - dmin mn            d sc     -dmin mn  (6-bit sc, mn per 32)
    Q5_K     5    32     d sc q - dmin mn            d sc     -dmin mn  (as Q4_K, a fifth bit in qh)
    Q6_K     6    16     d sc (q - 32)               d sc     -32 d sc  (int8 sc per 16)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

Q = GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class AffineBlocks:
    """An [rows, cols] matrix as codes, with per-block scales and offsets along each row."""
    codes: U8          # [rows, cols]                 0 <= code < 2**bits
    scale: F32         # [rows, cols // block_size]
    offset: F32        # [rows, cols // block_size]
    bits: int
    block_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    def dequantize(self) -> F32:
        """The float32 matrix [rows, cols]: scale * q + offset, block by block (the reference)."""
        rows, cols = self.shape
        q = self.codes.reshape(rows, -1, self.block_size).astype(np.float32)        # [rows, nb, bs]
        w = q * self.scale[:, :, None] + self.offset[:, :, None]
        return w.reshape(rows, cols)

    def with_block_size(self, block_size: int) -> AffineBlocks:
        """The same values with blocks of block_size (a divisor of the current one)."""
        if block_size == self.block_size:
            return self
        assert self.block_size % block_size == 0, (self.block_size, block_size)
        k = self.block_size // block_size
        return AffineBlocks(self.codes, np.repeat(self.scale, k, axis=1), np.repeat(self.offset, k, axis=1),
                            self.bits, block_size)


SUPPORTED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def check_blocks(data: npt.NDArray[Any], qtype: GGMLQuantizationType, shape: tuple[int, int]) -> None:
    """Raises ValueError unless `data` is whole blocks of a [rows, cols] matrix of a type in SUPPORTED
    (what affine_blocks would decode, checked without decoding it)."""
    if qtype not in _DECODERS:
        raise ValueError(f"no integer-code form for {qtype.name}")
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    if cols % block_elems or data.dtype != np.uint8 or data.size != rows * cols // block_elems * block_bytes:
        raise ValueError(f"{qtype.name} data of {data.size} bytes is not a [{rows}, {cols}] matrix")


def affine_blocks(data: npt.NDArray[Any], qtype: GGMLQuantizationType, shape: tuple[int, int]) -> AffineBlocks:
    """The tensor `data` (uint8 [rows, bytes per row], as a GGUF reader gives it) as codes.

    Raises ValueError for a type not in SUPPORTED or data that is not whole blocks of `shape`.
    """
    check_blocks(data, qtype, shape)
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(-1, GGML_QUANT_SIZES[qtype][1])     # [nb, block_bytes]
    bits, sub, decode = _DECODERS[qtype]
    codes, scale, offset = decode(blocks)       # [nb, block_elems], [nb, block_elems // sub] x2
    with np.errstate(all="ignore"):
        return AffineBlocks(codes.reshape(rows, cols), scale.reshape(rows, -1).astype(np.float32),
                            offset.reshape(rows, -1).astype(np.float32), bits, sub)


def _f16(columns: U8) -> F32:
    """[n, 2] bytes -> [n] float32 (little-endian float16)."""
    return np.ascontiguousarray(columns).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: U8) -> U8:
    """16 bytes per block, low nibbles are values 0..15 and high nibbles 16..31 -> [n, 32]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(b: U8) -> tuple[U8, F32, F32]:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d[:, None], (-8 * d)[:, None]


def _q4_1(b: U8) -> tuple[U8, F32, F32]:
    return _nibbles(b[:, 4:]), _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]


def _high_bits(qh: U8) -> U8:
    """4 bytes of a little-endian uint32 per block -> its 32 bits as [n, 32] of 0/1, bit j for value j."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _q5_0(b: U8) -> tuple[U8, F32, F32]:
    d = _f16(b[:, :2])
    q = (_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4)).astype(np.uint8)
    return q, d[:, None], (-16 * d)[:, None]


def _q5_1(b: U8) -> tuple[U8, F32, F32]:
    q = (_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)).astype(np.uint8)
    return q, _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None]


def _q8_0(b: U8) -> tuple[U8, F32, F32]:
    d = _f16(b[:, :2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d[:, None], (-128 * d)[:, None]


def _k_scales(b: U8) -> tuple[F32, F32]:
    """Q4_K's and Q5_K's scale and offset per sub-block of 32 ([n, 8] each): d, dmin (f16), then
    12 bytes packing 8 six-bit scales and 8 six-bit mins."""
    d, dmin, s = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16].astype(np.uint8)
    sc = np.empty((len(b), 8), dtype=np.uint8)
    mn = np.empty((len(b), 8), dtype=np.uint8)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return d[:, None] * sc, -(dmin[:, None] * mn)


def _q4_k(b: U8) -> tuple[U8, F32, F32]:
    """144-byte super-blocks of 256: d, dmin, the scales (_k_scales), 128 bytes of 4-bit q (each
    32 bytes: one sub-block in low nibbles, the next in high)."""
    qs = b[:, 16:].reshape(-1, 4, 32)                                                  # [n, 4, 32]
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)                        # sub-blocks in order
    return (q.astype(np.uint8), *_k_scales(b))


def _q5_k(b: U8) -> tuple[U8, F32, F32]:
    """176-byte super-blocks of 256: d, dmin, the scales (_k_scales), 32 bytes qh, 128 bytes of low
    4 bits laid out as Q4_K's; value l of sub-block k takes bit k of qh[l] as its fifth bit."""
    qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)                   # [n, 8, 32]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1        # [n, 8, 32]
    return ((low | (high << 4)).astype(np.uint8).reshape(-1, 256), *_k_scales(b))


def _q6_k(b: U8) -> tuple[U8, F32, F32]:
    """210-byte super-blocks of 256: ql (128 bytes, low 4 bits), qh (64 bytes, high 2 bits), 16 int8
    scales (one per 16 values), d (f16). Two halves of 128 values, each from 64 ql and 32 qh bytes."""
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    sc, d = b[:, 192:208].view(np.int8).astype(np.float32), _f16(b[:, 208:210])
    q = np.empty((len(b), 2, 128), dtype=np.uint8)
    q[:, :, 0:32] = (ql[:, :, 0:32] & 0x0F) | ((qh & 3) << 4)
    q[:, :, 32:64] = (ql[:, :, 32:64] & 0x0F) | (((qh >> 2) & 3) << 4)
    q[:, :, 64:96] = (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q[:, :, 96:128] = (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    scale = d[:, None] * sc
    return q.reshape(-1, 256), scale, -32 * scale


_DECODERS = {
    Q.Q4_0: (4, 32, _q4_0), Q.Q4_1: (4, 32, _q4_1), Q.Q5_0: (5, 32, _q5_0), Q.Q5_1: (5, 32, _q5_1),
    Q.Q8_0: (8, 32, _q8_0), Q.Q4_K: (4, 32, _q4_k), Q.Q5_K: (5, 32, _q5_k), Q.Q6_K: (6, 16, _q6_k),
}
