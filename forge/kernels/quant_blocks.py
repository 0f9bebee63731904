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
    Q2_K     2    16     d sc q - dmin mn            d sc     -dmin mn  (4-bit sc, mn per 16)
    Q3_K     3    16     d sc (q - 4)                d sc     -4 d sc   (6-bit sc - 32 per 16)
    IQ4_NL   8    32     d T[n]                      d       -128 d     (q = T[n] + 128)
    IQ4_XS   8    32     d (ls - 32) T[n]            dl      -128 dl    (6-bit ls per 32; q = T[n] + 128)
    MXFP4    5    32     2^(e - 128) E[n]            2^(e-128) -12 s    (q = E[n] + 12; e an E8M0 byte)

The last three are tables, not affine in the file's 4-bit index n: T is IQ4_NL's 16 int8 values
(IQ4_NL_VALUES), E MXFP4's E2M1 values doubled (MXFP4_VALUES: 0, 0.5, ... 6 as 0, 1, ... 12, as ggml
keeps them, the scale halved to match). The table's value itself is the code (shifted to be unsigned),
so the same form holds them exactly: d times an 8-bit (or 5-bit) integer plus an exact offset. For
MXFP4 that holds while s * 24 stays finite (e up to 251; ggml's own scales stop at 254).
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


SUPPORTED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS,
             Q.MXFP4)

# IQ4_NL's and IQ4_XS's 16 values (a non-uniform 4-bit grid), and MXFP4's E2M1 values doubled.
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


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


def _two_bit_planes(qs: U8) -> U8:
    """Q2_K's and Q3_K's 64 bytes of 2-bit codes: each 32 bytes hold 128 values, bits 2s..2s+1 of
    byte l being value 32 s + l -> [n, 256] in order."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).astype(np.uint8).reshape(-1, 256)


def _q2_k(b: U8) -> tuple[U8, F32, F32]:
    """84-byte super-blocks of 256: 16 scale bytes (scale in the low nibble, min in the high, per 16
    values), 64 bytes of 2-bit q (_two_bit_planes), d, dmin (f16)."""
    sc, d, dmin = b[:, :16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    return (_two_bit_planes(b[:, 16:80]), d[:, None] * (sc & 0x0F).astype(np.float32),
            -(dmin[:, None] * (sc >> 4).astype(np.float32)))


def _q3_k(b: U8) -> tuple[U8, F32, F32]:
    """110-byte super-blocks of 256: 32 bytes hmask (bit j of byte l: the third bit of value 32 j + l),
    64 bytes of low 2 bits (_two_bit_planes), 12 bytes packing 16 six-bit scales (sc - 32), d (f16).
    ggml reads value (low | high << 2) - 4."""
    hmask, low, s, d = b[:, :32], _two_bit_planes(b[:, 32:96]), b[:, 96:108], _f16(b[:, 108:110])
    high = ((hmask[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, 256)
    lo4 = (s[:, None, 0:8] >> np.array([0, 4], dtype=np.uint8)[None, :, None]).reshape(-1, 16) & 0x0F
    hi2 = (s[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]).reshape(-1, 16) & 3
    scale = d[:, None] * ((lo4 | (hi2 << 4)).astype(np.float32) - 32)
    return (low | (high << 2)).astype(np.uint8), scale, -4 * scale


def _table_codes(qs: U8, values: npt.NDArray[np.int16], shift: int) -> U8:
    """16 bytes of 4-bit indices per 32 values (low nibbles values 0..15, high 16..31) -> the table's
    values plus shift, as unsigned codes [n, 32]."""
    return (values[_nibbles(qs)] + shift).astype(np.uint8)


def _iq4_nl(b: U8) -> tuple[U8, F32, F32]:
    """18-byte blocks of 32: d (f16), 16 bytes of indices into IQ4_NL_VALUES."""
    d = _f16(b[:, :2])
    return _table_codes(b[:, 2:], IQ4_NL_VALUES, 128), d[:, None], (-128 * d)[:, None]


def _iq4_xs(b: U8) -> tuple[U8, F32, F32]:
    """136-byte super-blocks of 256: d (f16), scales_h (uint16: 2 high bits per 32), scales_l (4 bytes:
    a low nibble per 32), then 8 x 16 bytes of indices into IQ4_NL_VALUES, laid out as IQ4_NL's."""
    d, high = _f16(b[:, :2]), b[:, 2:4].copy().view(np.uint16)                         # [n], [n, 1]
    low = (b[:, 4:8, None] >> np.array([0, 4], dtype=np.uint8)[None, None, :]).reshape(-1, 8) & 0x0F
    high_bits = ((high >> (2 * np.arange(8, dtype=np.uint16))[None, :]) & 3).astype(np.uint8)   # [n, 8]
    dl = d[:, None] * ((low | (high_bits << 4)).astype(np.float32) - 32)
    codes = _table_codes(b[:, 8:].reshape(-1, 16), IQ4_NL_VALUES, 128).reshape(-1, 256)
    return codes, dl, -128 * dl


def e8m0_half(e: U8) -> F32:
    """MXFP4's scale byte e as 2^(e - 128) (half the E8M0 value, as the doubled table wants), exactly:
    e of 0 and 1 are float32 subnormals."""
    e32 = e.astype(np.uint32)
    bits = np.where(e32 < 2, np.uint32(0x00200000) << e32, (e32 - 1) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


def _mxfp4(b: U8) -> tuple[U8, F32, F32]:
    """17-byte blocks of 32: e (E8M0), 16 bytes of 4-bit E2M1 indices (MXFP4_VALUES)."""
    d = e8m0_half(np.ascontiguousarray(b[:, 0]))
    return _table_codes(b[:, 1:], MXFP4_VALUES, 12), d[:, None], (-12 * d)[:, None]


_DECODERS = {
    Q.Q4_0: (4, 32, _q4_0), Q.Q4_1: (4, 32, _q4_1), Q.Q5_0: (5, 32, _q5_0), Q.Q5_1: (5, 32, _q5_1),
    Q.Q8_0: (8, 32, _q8_0), Q.Q4_K: (4, 32, _q4_k), Q.Q5_K: (5, 32, _q5_k), Q.Q6_K: (6, 16, _q6_k),
    Q.Q2_K: (2, 16, _q2_k), Q.Q3_K: (3, 16, _q3_k), Q.IQ4_NL: (8, 32, _iq4_nl), Q.IQ4_XS: (8, 32, _iq4_xs),
    Q.MXFP4: (5, 32, _mxfp4),
}
