"""The deterministic product's own layout of a weight (forge/kernels/qmatmul_det_pack.h): packed once at
load, it gives exactly the bits of the file's blocks and of the definition (forge.kernels.det_reference) on
every build level this host runs, whatever the step's rows, for every type and for weight rows that fill no
whole group; it takes the file's bytes (give or take its padding), and a BlockMatrix in these numerics reads
it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from gguf.constants import GGMLQuantizationType

from forge.kernels import compiled, det_reference, products
from forge.kernels.quant_linear import BlockMatrix, release_file_pages
from forge.models.llama.experts import ExpertStack
from tests.unit.test_block_linear import RUNNABLE
from tests.unit.test_det_numerics import ROWS, TYPES, bits
from tests.unit.test_kernels import random_blocks
from tests.unit.test_moe_grouped import expert_tensor

Q = GGMLQuantizationType


def packed_product(x: npt.NDArray[np.float32], packed: npt.NDArray[np.uint8], ptype: int, n: int, k: int,
                   isa: str) -> npt.NDArray[np.float32]:
    lib = compiled.library() if isa == "native" else compiled.library_at(isa)
    out = np.empty((x.shape[0], n), dtype=np.float32)
    products.qmatmul_det(np.ascontiguousarray(x), k, products.qparts_rows([(packed, ptype, n)]), out, lib=lib)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_packed_weight_gives_the_definitions_bits(qtype: GGMLQuantizationType) -> None:
    """Packed by every level's build alike, read by every level's (the layout is the same everywhere): 5, 37 and
    64 weight rows (less than a group, a group and a part, whole groups), steps across every path's
    bounds."""
    rng = np.random.default_rng(100 + int(qtype))
    k = 768 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96
    x = (rng.standard_normal((max(ROWS), k)) * rng.uniform(0.01, 30, (max(ROWS), 1))).astype(np.float32)
    for n in (5, 37, 64):
        data = random_blocks(rng, qtype, n, k)
        packed, ptype = products.det_pack(data, int(qtype), k)
        assert ptype == int(qtype) | products.DET_PACKED
        for isa in RUNNABLE:             # the scalar packing and the vector builds' write the same bytes
            lib = compiled.library() if isa == "native" else compiled.library_at(isa)
            assert np.array_equal(products.det_pack(data, int(qtype), k, lib=lib)[0], packed), f"{qtype.name} {isa}"
        assert packed.nbytes <= data.nbytes / n * (-(-n // 32) * 32) * 1.03   # the file's bytes, padded rows
        for rows in ROWS:
            want = det_reference.matmul(x[:rows], data, qtype, (n, k))
            for isa in RUNNABLE:
                got = packed_product(x[:rows], packed, ptype, n, k, isa)
                assert np.array_equal(bits(got), bits(want)), f"{qtype.name} n={n} rows={rows} {isa}"


def test_packing_refuses_what_the_product_does_not_read() -> None:
    data = np.zeros((4, 18), dtype=np.uint8)
    with pytest.raises(ValueError, match="det_pack"):
        products.det_pack(data, int(Q.Q2_K), 256)
    with pytest.raises(ValueError, match="det_pack"):
        products.det_pack(data, int(Q.Q4_0), 40)


def test_a_block_matrix_in_these_numerics_reads_its_packed_copy() -> None:
    """Two parts (a fused q/k/v's way): the packed matrix, the file's blocks under the same numerics and the
    definition agree bit for bit; the packed one counts its own bytes."""
    rng = np.random.default_rng(7)
    k = 512
    parts = [(random_blocks(rng, Q.Q4_K, 40, k), int(Q.Q4_K)), (random_blocks(rng, Q.Q6_K, 24, k), int(Q.Q6_K))]
    packed = BlockMatrix(parts, k, det=True)
    plain = BlockMatrix(parts, k, det=True, pack=False)
    assert packed.packed and not plain.packed
    assert packed.nbytes >= plain.nbytes
    x = rng.standard_normal((6, k)).astype(np.float32)
    want = np.concatenate([det_reference.matmul(x, b, Q(t), (b.shape[0], k)) for b, t in parts], axis=1)
    for rows in (1, 6):
        assert np.array_equal(bits(packed.matmul(x[:rows])), bits(plain.matmul(x[:rows])))
        assert np.array_equal(bits(packed.matmul(x[:rows])), bits(want[:rows]))
    assert not BlockMatrix(parts, k).packed                     # the reference numerics read the file's pages


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0], ids=lambda t: t.name)
def test_a_mixtures_experts_are_packed_and_keep_the_definitions_bits(qtype: GGMLQuantizationType) -> None:
    """The grouped product (moe_matmul.c) over packed experts (gate and up stacked): each group's rows get
    the definition's product with its expert; an expert's rows that are not whole groups of 32 keep the
    file's blocks (and the same bits)."""
    rng = np.random.default_rng(11 + int(qtype))
    experts, k = 5, 256
    for ffn in (64, 48):
        tensors = [expert_tensor(rng, qtype, experts, ffn, k)[0] for _ in range(2)]
        stack = ExpertStack([(t, qtype) for t in tensors], k, kernel=True, det=True)
        assert bool(stack._packed) == (ffn % 32 == 0)
        x = rng.standard_normal((9, k)).astype(np.float32)
        ids, starts = np.array([3, 0, 4], np.int64), np.array([0, 2, 3, 9], np.int64)
        got = stack.grouped(x, ids, starts)
        for g, expert in enumerate(ids):
            rows = x[starts[g]:starts[g + 1]]
            want = np.concatenate([det_reference.matmul(rows, t[expert], qtype, (ffn, k)) for t in tensors], axis=1)
            assert np.array_equal(bits(got[starts[g]:starts[g + 1]]), bits(want)), f"ffn={ffn} expert {expert}"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_the_packed_weights_file_pages_leave_the_process_and_stay_readable(tmp_path: Path) -> None:
    """After packing, the file's pages under a weight are unmapped (RSS counts the packed copy, not both);
    the file's bytes read the same after; an array of the process's own memory is never touched (madvise
    would zero it)."""
    size = 64 << 20
    path = tmp_path / "weights.bin"
    path.write_bytes(np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r").reshape(1024, -1)
    total = int(mapped.sum(dtype=np.uint64))                                    # every page mapped
    before = _rss_bytes()
    assert release_file_pages(mapped)
    assert _rss_bytes() < before - size // 2
    assert int(mapped.sum(dtype=np.uint64)) == total
    own = np.arange(1 << 20, dtype=np.uint8)
    assert not release_file_pages(own)
    assert np.array_equal(own, np.arange(1 << 20, dtype=np.uint8))
