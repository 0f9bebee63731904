"""y = x @ W.T with W in the GGUF file's own blocks: the `blocks` backend (forge.kernels).

A BlockMatrix holds views of the file's mapping (or, for rows a family reorders, one reordered copy
made instead of the original), nothing else: its weights are resident once, as the file's pages.
The product is qmatmul.c: every weight widened to float32 in registers exactly as the file means
it, float32 accumulation (or, in the fast numerics, x and the weights rounded to bfloat16 and
multiplied in pairs), on the compiled kernels' own threads. forge.kernels.quant_blocks' dequantize()
is the reference it is tested against.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np
import numpy.typing as npt

from forge.kernels import products

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


# madvise(2)'s MADV_DONTNEED: a file mapping's pages unmapped from the process (they stay in the page cache; a
# later read maps them again). Never on anonymous memory, which it would zero.
MADV_DONTNEED = 4


def release_file_pages(data: npt.NDArray[np.generic]) -> bool:
    """Unmap the whole pages under `data` from the process, where `data` is a view of a file's mapping (an mmap
    under its bases: the GGUF file's); True if it did. A packed copy has been made of them: the process's RSS
    then counts the copy, not the file's pages too."""
    base: object = data
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or data.nbytes == 0:
        return False
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page                     # whole pages inside the view only
    end = (data.ctypes.data + data.nbytes) // page * page
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0)
    except (OSError, AttributeError):
        return False


def as_blocks(data: npt.NDArray[np.generic], rows: int) -> U8:
    """A tensor's data as uint8 [rows, bytes per row] without copying where it can (a plain-typed
    tensor, F32 or F16, is viewed as its bytes)."""
    raw = data if data.dtype == np.uint8 else data.view(np.uint8)
    return np.ascontiguousarray(raw.reshape(rows, -1))


class BlockMatrix:
    """W [N, K]: the parts (blocks [rows_i, bytes], ggml type) stacked along N, multiplied as
    x [T, K] @ W.T -> [T, N] (a fused q/k/v or gate/up is one BlockMatrix). `fast`: the products
    in bfloat16 (forge.kernels' fast numerics; the CPU must have AVX-512 BF16); `det`: the
    deterministic numerics' (qmatmul_det.c). Thread-safe."""

    def __init__(self, parts: list[tuple[U8, int]], in_features: int, fast: bool = False, det: bool = False,
                 pack: bool = True) -> None:
        self._parts = parts                                  # keeps the views (and so the mapping) alive
        self.fast = fast
        # The deterministic numerics where it reads every part's type; others keep the reference product.
        self.det = det and all(products.det_type(int(qtype)) for _, qtype in parts)
        self.in_features = in_features
        self.out_features = sum(blocks.shape[0] for blocks, _ in parts)
        # Bytes of weights it reads: pages of the file's mapping (shared with the page cache), or
        # of the one reordered copy.
        self.nbytes = sum(int(blocks.nbytes) for blocks, _ in parts)
        self._packed: list[tuple[U8, int, int]] = []
        if self.det and pack:
            # The deterministic product's own layout (qmatmul_det_pack.h), made once: the product reads it instead
            # of the file's pages (the file's bytes, K-quants 2-3% more, in memory of its own), with the same bits.
            for blocks, qtype in parts:
                packed, ptype = products.det_pack(blocks, int(qtype), in_features)
                self._packed.append((packed, ptype, blocks.shape[0]))
                release_file_pages(blocks)
            self._descriptor = products.qparts_rows(self._packed)
            self.nbytes = sum(int(p.nbytes) for p, _, _ in self._packed)
        else:
            self._descriptor = products.qparts(parts)

    @property
    def packed(self) -> bool:
        """Whether the product reads a packed copy (memory of its own) rather than the file's pages."""
        return bool(self._packed)

    @property
    def shape(self) -> tuple[int, int]:
        """[in, out], as the dense weights the model multiplies by on the right."""
        return self.in_features, self.out_features

    @property
    def types(self) -> list[int]:
        return [int(qtype) for _, qtype in self._parts]

    def matmul(self, x: F32) -> F32:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)       # [T, N]
        if self.det:
            products.qmatmul_det(x, self.in_features, self._descriptor, out)
        else:
            products.qmatmul(x, self.in_features, self._descriptor, out, fast=self.fast)
        return out

    def reads(self, array: npt.NDArray[np.generic]) -> bool:
        """Whether `array`'s memory is (part of) what this matrix reads."""
        return any(np.shares_memory(blocks, array) for blocks, _ in self._parts)

    def rows(self, ids: npt.NDArray[np.int64]) -> F32:
        """Rows `ids` of W as float32 [n, K] (the token embedding, when W is the tied head);
        only for a single-part matrix."""
        assert len(self._parts) == 1, "rows() of a stacked BlockMatrix"
        blocks, qtype = self._parts[0]
        return products.dequant_rows(blocks, qtype, self.in_features, ids)
