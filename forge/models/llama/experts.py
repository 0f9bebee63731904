"""How a layer's experts are held: every expert's projection as a view of the file's 3-D tensor.

llama.cpp's converter stacks each projection of a layer's experts into one tensor [experts, rows,
cols] (ffn_gate_exps, ffn_up_exps, ffn_down_exps). An ExpertStack hands out expert e's [in, out]
weight for forge.models.llama.linear's matmul: a BlockMatrix over that expert's own rows of the
file's blocks (the compiled products, forge.kernels.quant_linear: no copy), or, for the numpy
reference and for types the compiled products do not read, that expert's rows dequantized when a
step uses it. Nothing proportional to the model is decoded or copied at load: the experts stay in
the file's pages, quantized. A kernel-held stack also multiplies a whole step at once: grouped()
runs every active expert's rows in one call on the kernel pool (forge/kernels/moe_matmul.c), with
the bits of one product per expert. The arithmetic of the block is forge.models.llama.mixture's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGMLQuantizationType

from forge.kernels import products
from forge.kernels.quant_linear import BlockMatrix, as_blocks, release_file_pages
from forge.models.llama.dequant import dequantize
from forge.models.llama.weight_types import Weight

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
# One part of a stack: the file's tensor [experts, rows, bytes per row] (a quantized type) or
# [experts, rows, cols] (a plain one), and its type.
ExpertPart = tuple[npt.NDArray[Any], GGMLQuantizationType]


class ExpertStack:
    """One projection of every expert of a layer, the parts side by side (gate then up): expert e's
    weight W_e [in, out] = the parts' rows of expert e, transposed. Thread-safe (read-only)."""

    def __init__(self, parts: list[ExpertPart], in_features: int, *, kernel: bool, fast: bool = False,
                 det: bool = False) -> None:
        self._parts = parts                  # views of the file's mapping: they keep it alive
        self.num_experts = int(parts[0][0].shape[0])
        self.in_features = in_features
        self.out_features = sum(int(data.shape[1]) for data, _ in parts)
        self.nbytes = sum(int(data.nbytes) for data, _ in parts)       # the file's pages, counted once
        self.fast = fast
        self.det = det                       # the deterministic numerics (qmatmul_det.c)
        # grouped()'s view of the parts: each whole 3-D tensor as rows of blocks, its `rows` one expert's.
        self._grouped = None
        self._packed: list[tuple[npt.NDArray[np.uint8], int, int]] = []
        if kernel:
            whole = [(as_blocks(data, int(data.shape[0]) * int(data.shape[1])), int(qtype)) for data, qtype in parts]
            if det and all(products.det_type(qtype) and data.shape[1] % 32 == 0 for data, qtype in parts):
                # The deterministic product's own layout (qmatmul_det_pack.h), every expert's rows in turn: the
                # file's bytes (K-quants 2-3% more) in memory of its own, read faster by a step's few rows
                # (docs/benchmarks.md).
                self._packed = [(*products.det_pack(blocks, qtype, in_features), int(data.shape[1]))
                                for (blocks, qtype), (data, _) in zip(whole, parts, strict=True)]
                self._grouped = products.qparts_rows(self._packed)
                for blocks, _ in whole:
                    release_file_pages(blocks)
            else:
                self._grouped = products.qparts(whole)
                for part, (data, _) in zip(self._grouped, parts, strict=True):
                    part.rows = int(data.shape[1])
        # Expert e's own BlockMatrix over its rows of every part, made when first asked for (a model's
        # steps multiply by grouped(); made at load, 12,288 of them took 0.45 s of a 30B-A3B's start-up).
        self._kernels: dict[int, BlockMatrix] = {}

    @property
    def shape(self) -> tuple[int, int]:
        """[in, out] of each expert's weight."""
        return self.in_features, self.out_features

    @property
    def is_kernel(self) -> bool:
        """Whether the compiled products multiply the file's blocks (else: dequantized per step)."""
        return self._grouped is not None

    def __getitem__(self, expert: int) -> Weight:
        """Expert `expert`'s weight [in, out]: its BlockMatrix, or its rows dequantized now (a
        float32 copy of this expert only, F-ordered when there is one part)."""
        if self._grouped is not None:
            matrix = self._kernels.get(expert)
            if matrix is None:               # racing threads may each make one: the same, and cheap
                matrix = BlockMatrix([(as_blocks(data[expert], data.shape[1]), int(qtype))
                                      for data, qtype in self._parts], self.in_features, fast=self.fast,
                                     det=self.det, pack=False)      # the grouped product reads the file's blocks
                self._kernels[expert] = matrix
            return matrix
        rows = [dequantize(data[expert], qtype).astype(np.float32, copy=False) for data, qtype in self._parts]
        if len(rows) == 1:
            return rows[0].T                                             # [in, out] view of [out, in]
        out: F32 = np.concatenate(rows).T                                # [in, sum of rows]
        return out

    def grouped(self, x: F32, experts: I64, starts: I64) -> F32:
        """Every group's rows of x [N, in] times its expert's weight, in one call on the kernel pool:
        rows [starts[g], starts[g + 1]) by expert experts[g] (ascending or not), -> [N, out]. Only for a
        kernel-held stack (is_kernel); each group's rows get the bits of self[expert].matmul(rows)."""
        assert self._grouped is not None, "grouped() of a stack the compiled products do not read"
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)                # [N, out]
        products.moe_matmul(x, self.in_features, self._grouped, self.num_experts, experts, starts, out, fast=self.fast,
                            det=self.det)
        return out

    def reads(self, array: npt.NDArray[Any]) -> bool:
        """Whether `array`'s memory is (part of) what this stack reads."""
        return any(np.shares_memory(data, array) for data, _ in self._parts)

    def map_pages(self) -> None:
        """Map every page of the experts' file bytes into the process now (see prefault_experts); a packed
        stack's memory is its own, written at load: nothing to map."""
        if self._packed:
            return
        for data, _ in self._parts:
            _map_pages(data)


@dataclass(slots=True)
class MoeWeights:
    """A layer's mixture of experts (forge.models.llama.mixture): the router, the experts, gpt-oss's
    biases, and qwen2moe's shared expert with its gate."""
    router: Weight                         # [H, E]    logits of every expert for a token
    gate_up: ExpertStack                   # expert e: [H, 2 F]   columns: gate, then up
    down: ExpertStack                      # expert e: [F, H]
    shared_gate_up: Weight | None = None   # [H, 2 Fs]  the shared expert (qwen2moe)
    shared_down: Weight | None = None      # [Fs, H]
    shared_gate: Weight | None = None      # [H, 1]     its output times sigmoid(x @ shared_gate)
    router_bias: F32 | None = None         # [E]        added to the router's logits (gpt-oss)
    gate_up_bias: F32 | None = None        # [E, 2 F]   expert e's gate and up biases
    down_bias: F32 | None = None           # [E, H]

    @property
    def is_dense(self) -> bool:
        """Every part a float32 array or dequantized per step (the numpy reference)."""
        return not (self.gate_up.is_kernel or self.down.is_kernel) and all(
            w is None or isinstance(w, np.ndarray) for w in (self.router, self.shared_gate_up, self.shared_down,
                                                              self.shared_gate))

    @property
    def nbytes(self) -> int:
        parts = (self.router, self.gate_up, self.down, self.shared_gate_up, self.shared_down, self.shared_gate,
                 self.router_bias, self.gate_up_bias, self.down_bias)
        return sum(int(w.nbytes) for w in parts if w is not None)


# madvise(2)'s MADV_POPULATE_READ (Linux 5.14): map a range's pages, reading them in where they are not
# in the page cache, in one call.
MADV_POPULATE_READ = 22


def _map_pages(data: npt.NDArray[Any]) -> None:
    """The pages under `data` (a view of the file's mapping) mapped into the process: one madvise, or
    where the kernel has no MADV_POPULATE_READ one read a page."""
    page = mmap.PAGESIZE
    start = data.ctypes.data // page * page
    length = data.ctypes.data + data.nbytes - start
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_POPULATE_READ) == 0:
            return
    except (OSError, AttributeError):
        pass
    flat = data.reshape(-1).view(np.uint8)
    int(flat[::page].max(initial=0))


def prefault_experts(stacks: list[ExpertStack]) -> threading.Thread | None:
    """Map the experts' pages of the file into the process in a background thread, started now; None
    when they are more than the machine's memory. A step's experts are a few of many (8 of 128 in
    each of a 30B-A3B's 48 layers), so the first time a page is read falls on a step for a long while
    after start: a minor fault of ~0.9 us a page (measured on the 2-core VM), 5x the time an expert takes
    from memory, until every expert has been chosen once. Mapped ahead, the daemon is ready at once
    and its first steps read pages already mapped (RSS grows to the experts' bytes: the file's pages,
    as a dense model's first step makes it)."""
    total = sum(stack.nbytes for stack in stacks)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    if not stacks or total > memory:
        return None

    def run() -> None:
        for stack in stacks:
            stack.map_pages()

    thread = threading.Thread(target=run, name="forge-map-experts", daemon=True)
    thread.start()
    return thread
