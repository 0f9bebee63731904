"""forge.models.gguf_file against the gguf library's own reader: the same metadata, tensors and bytes,
on a written file with every value type and on the real default model; malformed files are one-line
ModelLoadErrors."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from forge.errors import ModelLoadError
from forge.models.gguf_file import read_gguf
from tests.tiny_gguf import write_tiny_llama


def same_value(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, np.ndarray):
        return list(ours.tolist()) == list(theirs)
    if isinstance(ours, list):
        return len(ours) == len(theirs) and all(same_value(a, b) for a, b in zip(ours, theirs, strict=True))
    if isinstance(ours, float):
        return ours == pytest.approx(theirs, rel=1e-7)
    return bool(ours == theirs)


def assert_matches_the_gguf_library(path: Path) -> None:
    ours = read_gguf(path)
    theirs = gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]   # the library's header pseudo-fields
    assert sorted(ours.metadata) == sorted(keys)
    for key in keys:
        assert same_value(ours.metadata[key], theirs.fields[key].contents()), key
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type, t.name
        assert mine.data.shape == t.data.shape and mine.data.dtype == t.data.dtype, t.name
        assert np.array_equal(mine.data, t.data), t.name
        assert mine.shape == tuple(int(d) for d in reversed(t.shape)), t.name


def test_every_value_type_reads_as_the_library_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.empty", [])
    writer.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("half", np.arange(6, dtype=np.float16).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_matches_the_gguf_library(path)
    f = read_gguf(path)
    assert f.get("t.bool") is True and f.get("t.str") == "héllo ✓" and f.get("t.strs") == ["a", "", "ü"]
    assert f.get("t.u64") == 2**60 and f.get("t.i8") == -5 and f.get("missing") is None
    assert np.array_equal(f.tensors["plain"].data, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_a_quantized_model_file_reads_as_the_library_reads_it(tmp_path: Path) -> None:
    assert_matches_the_gguf_library(write_tiny_llama(tmp_path / "q.gguf", quant="Q4_1"))


def test_the_default_model_reads_as_the_library_reads_it(default_model_path: Path) -> None:
    assert_matches_the_gguf_library(default_model_path)


def _error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        read_gguf(path)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("cut", [3, 10, 30, 200, 2000, -8])
def test_a_truncated_file_is_a_load_error(tmp_path: Path, cut: int) -> None:
    whole = write_tiny_llama(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    _error(path)


def test_wrong_magic_version_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    assert "magic" in _error(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3 << 24, 0, 0))
    assert "big-endian" in _error(path)
    assert "not found" in _error(tmp_path / "absent.gguf")


def test_a_tensor_claiming_more_bytes_than_the_file_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    name = b"w"
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
    info = struct.pack("<Q", len(name)) + name + struct.pack("<I", 2) + struct.pack("<QQ", 2**40, 2**40)
    info += struct.pack("<IQ", 0, 0)                                  # F32 at offset 0
    path.write_bytes(header + info + bytes(64))
    assert "past the end" in _error(path)
