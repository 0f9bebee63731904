"""Reading a GGUF file's header: its metadata as Python values, its tensors as views of the file.

The gguf library's reader builds a numpy view for every part of every field, 100,000 of them for a
49k-token vocabulary, and takes seconds; forge reads the header in one pass with struct instead and
maps the tensor data with numpy. Dequantizing stays with the gguf library (forge.models.llama.weights).
Only little-endian files (all that llama.cpp writes today) are read; anything malformed is a
ModelLoadError with a one-line message.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
# numpy dtypes of the unquantized tensor types (their data is viewed with these, not as bytes)
_PLAIN_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}

# A metadata value: int, float, bool, str (bytes when it is not UTF-8), a numpy array for arrays of
# numbers, a list for arrays of strings or of arrays.
Value = Any


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]          # numpy order (the file lists dimensions innermost first)
    data: npt.NDArray[Any]          # read-only view of the file: the plain dtype in `shape`, or for a
                                    # quantized type uint8 [*shape[:-1], bytes per row]


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Value]
    tensors: dict[str, TensorInfo]

    def get(self, key: str) -> Value | None:
        return self.metadata.get(key)


_LENGTH = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: memoryview, name: str) -> None:
        self.buf, self.pos, self.name = buf, 0, name

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.name}: not a readable GGUF file ({what} at byte {self.pos})")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise self.fail("truncated header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str | bytes:
        return self.strings(1)[0]

    def value(self, kind: int, depth: int = 0) -> Value:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY or depth > 4:
            raise self.fail(f"unknown value type {kind}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind in _SCALARS:
            dtype = np.dtype(_SCALARS[item_kind][1])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise self.fail("truncated array")
            array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return array
        if count > len(self.buf):           # every item takes at least a byte
            raise self.fail("array longer than the file")
        if item_kind == _STRING:
            return self.strings(count)
        return [self.value(item_kind, depth + 1) for _ in range(count)]

    def strings(self, count: int) -> list[str | bytes]:
        """`count` strings in a row, each its length (u64) then its bytes: text, or the bytes when they are
        not UTF-8. One loop over local names, for a vocabulary's 262,144 (Gemma): half the time of a call
        per string."""
        buf, pos, size, read_length = self.buf, self.pos, len(self.buf), _LENGTH.unpack_from
        out: list[str | bytes] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail("truncated header")
            (n,) = read_length(buf, pos)
            pos += 8
            if pos + n > size:
                self.pos = pos
                raise self.fail("truncated string")
            try:
                append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                append(bytes(buf[pos:pos + n]))
            pos += n
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse the header of the GGUF file at `path` and map its tensors (read-only)."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ModelLoadError(f"model file not found: {name}")
    short = os.path.basename(name)
    try:
        mapped = np.memmap(name, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{short}: cannot read the file ({' '.join(str(exc).split())[:160]})") from exc
    cur = _Cursor(mapped.data, short)  # the array's own memoryview: numpy's stubs do not type memmap as a Buffer
    if len(mapped) < 24 or bytes(mapped[:4]) != MAGIC:
        raise ModelLoadError(f"{short}: not a readable GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ModelLoadError(f"{short}: GGUF version {version} is not supported{hint}")
    num_tensors, num_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if num_kv > len(mapped) or num_tensors > len(mapped):
        raise cur.fail("counts larger than the file")
    metadata: dict[str, Value] = {}
    for _ in range(num_kv):
        key = cur.string()
        if isinstance(key, bytes):
            raise cur.fail("a metadata key that is not UTF-8")
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(num_tensors):
        tensor_name = cur.string()
        if isinstance(tensor_name, bytes):
            raise cur.fail("a tensor name that is not UTF-8")
        num_dims = cur.unpack("<I")
        if num_dims > 8:
            raise cur.fail(f"tensor {tensor_name!r} with {num_dims} dimensions")
        dims = tuple(cur.unpack("<Q") for _ in range(num_dims))
        kind, offset = cur.unpack("<I"), cur.unpack("<Q")
        infos.append((tensor_name, dims, kind, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{short}: bad general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for tensor_name, dims, kind, offset in infos:
        tensors[tensor_name] = _tensor(mapped, short, tensor_name, dims, kind, data_start + offset)
    return GGUFFile(name, version, metadata, tensors)


def _tensor(mapped: np.memmap, short: str, name: str, dims: tuple[int, ...], kind: int, start: int) -> TensorInfo:
    try:
        qtype = GGMLQuantizationType(kind)
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelLoadError(f"{short}: tensor {name!r} has an unknown type {kind}") from None
    shape = tuple(int(d) for d in reversed(dims))                 # numpy order: outermost first
    row = shape[-1] if shape else 1
    if row % block_elems:
        raise ModelLoadError(f"{short}: tensor {name!r} rows of {row} do not fill {qtype.name} blocks")
    nbytes = math.prod(shape) // block_elems * block_bytes                       # Python ints: no overflow
    if start < 0 or start + nbytes > len(mapped):
        raise ModelLoadError(f"{short}: tensor {name!r} runs past the end of the file (truncated?)")
    raw = mapped[start:start + nbytes]
    plain = _PLAIN_DTYPES.get(qtype)
    if plain is not None:
        data = raw.view(plain).reshape(shape)
    else:
        data = raw.reshape(*shape[:-1], row // block_elems * block_bytes)
    return TensorInfo(name, qtype, shape, data)
