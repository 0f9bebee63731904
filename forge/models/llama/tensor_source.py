"""Where the forward's tensors come from: a GGUF file's tensors looked up by name, with checked shapes, as
float32 arrays or as kernels over the file's own blocks (forge.kernels, the backend the caller chose), and
the token embedding kept in its blocks. forge.models.llama.weights assembles the model from these.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from forge.errors import ModelLoadError
from forge.kernels import KernelChoice, compiled, products
from forge.kernels.quant_blocks import SUPPORTED, affine_blocks, check_blocks
from forge.kernels.quant_linear import BlockMatrix, as_blocks
from forge.models.gguf_file import GGUFFile
from forge.models.llama.dequant import dequantize
from forge.models.llama.experts import ExpertStack
from forge.models.llama.weight_types import Weight

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
SIXTEEN_BIT = (GGMLQuantizationType.F16, GGMLQuantizationType.BF16)    # kept as they are under blocks


class QuantEmbedding:
    """The token embedding [V, H] kept in its GGUF blocks; rows are dequantized when looked up."""

    def __init__(self, data: npt.NDArray[np.uint8], qtype: GGMLQuantizationType, shape: tuple[int, int],
                 *, copy: bool = True) -> None:
        # [V, bytes per row]: a copy when the file's mapping may close, else a view of it.
        self.data = np.array(data, dtype=np.uint8) if copy else np.ascontiguousarray(data, dtype=np.uint8)
        self.qtype = qtype
        self.shape = shape
        self.nbytes = self.data.nbytes

    def rows(self, token_ids: npt.NDArray[np.int64]) -> F32:
        """[T, H] float32, exactly the file's values (forge.models.llama.dequant)."""
        out: F32 = dequantize(self.data[token_ids], self.qtype).astype(np.float32, copy=False)
        return out


class TensorSource:
    """Looks tensors up by name and dequantizes them to float32 with checked shapes."""

    def __init__(self, reader: GGUFFile, model_name: str, kernels: KernelChoice | None) -> None:
        self._tensors = reader.tensors
        self._model_name = model_name
        self._kernels = kernels if kernels is not None and kernels.backend in ("onnxruntime", "blocks") else None
        self._blocks = self._kernels is not None and self._kernels.backend == "blocks"
        self.fast = self._blocks and self._kernels is not None and self._kernels.fast_products   # bfloat16/int8
        self.det = self._blocks and self._kernels is not None and self._kernels.det_products     # qmatmul_det.c
        self._num_threads = _usable_cores()
        if self._blocks:
            products.pool_threads(self._num_threads)

    def matrix(self, names: list[str], shapes: list[tuple[int, int]], *, f_ordered: bool = False,
               row_orders: list[I64 | None] | None = None) -> Weight:
        """The [out_i, in] matrices side by side as one [in, sum(out_i)] weight: a kernel over the
        file's blocks when the backend and their types allow, else dense float32 (fused; with
        f_ordered and one matrix, the F-ordered view of the file's [out, in]). shapes are the file's
        tensors'; row_orders[i], when given, picks and orders the rows taken from tensor i (the
        file's row row_orders[i][r] becomes row r: a reordering, or a part of a fused tensor)."""
        orders = row_orders or [None] * len(names)
        if self._blocks and shapes[0][1] % 32 == 0 and all(
                int(self._tensor(n).tensor_type) in products.QMATMUL_TYPES for n in names):
            return self._block_matrix(names, shapes, orders)
        if self._kernels is not None and all(self._tensor(n).tensor_type in SUPPORTED for n in names):
            from forge.kernels.onnx_linear import ACCURACY_FP32, ACCURACY_INT8, OnnxLinear

            parts = []
            for name, shape, order in zip(names, shapes, orders, strict=True):
                tensor = self._tensor(name)
                data = tensor.data if order is None else tensor.data[order]    # whole rows of blocks
                try:
                    if order is not None and tensor.data.shape[0] != shape[0]:
                        raise ValueError(f"has {tensor.data.shape[0]} rows, expected {shape[0]}")
                    parts.append(affine_blocks(data, tensor.tensor_type, (len(data), shape[1])))
                except ValueError as exc:
                    raise ModelLoadError(f"{self._model_name}: tensor {name!r}: {exc}") from exc
            level = ACCURACY_INT8 if self._kernels.int8_activations else ACCURACY_FP32
            return OnnxLinear(parts, num_threads=self._num_threads, accuracy_level=level, amx=self._kernels.amx)
        if f_ordered and len(names) == 1 and orders[0] is None:
            return self.owned(names[0], shapes[0]).T
        return self.fused(names, shapes, orders)

    def _block_matrix(self, names: list[str], shapes: list[tuple[int, int]], orders: list[I64 | None]) -> BlockMatrix:
        """The matrices as one BlockMatrix over the file's own bytes; rows a family reorders (or
        picks out of a fused tensor) copied once, in their new order, instead of the original."""
        parts = []
        for name, shape, order in zip(names, shapes, orders, strict=True):
            tensor = self._tensor(name)
            try:
                if tensor.data.shape[0] != shape[0]:
                    raise ValueError(f"has {tensor.data.shape[0]} rows, expected {shape[0]}")
                blocks = as_blocks(tensor.data, shape[0])
                block_elems, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
                if shape[1] % block_elems or blocks.shape[1] != shape[1] // block_elems * block_bytes:
                    raise ValueError(f"is not a [{shape[0]}, {shape[1]}] matrix of whole blocks")
            except ValueError as exc:
                raise ModelLoadError(f"{self._model_name}: tensor {name!r}: {exc}") from exc
            if order is not None:
                blocks = np.ascontiguousarray(blocks[order])
            parts.append((blocks, int(tensor.tensor_type)))
        return BlockMatrix(parts, shapes[0][1], fast=self.fast, det=self.det)

    def experts(self, names: list[str], in_features: int) -> ExpertStack:
        """The 3-D expert tensors `names` ([experts, rows_i, in] each, checked by the layout) side by
        side, as views of the file: multiplied from their blocks by the compiled products under the
        blocks and onnxruntime backends where those read the types, else dequantized per step."""
        parts = [(self._tensor(n).data, self._tensor(n).tensor_type) for n in names]
        kernel = (self._kernels is not None and compiled.library() is not None and in_features % 32 == 0
                  and all(int(qtype) in products.QMATMUL_TYPES for _, qtype in parts))
        return ExpertStack(parts, in_features, kernel=kernel, fast=self.fast, det=self.det)

    def keeps_blocks(self, name: str, qtype: GGMLQuantizationType | None = None) -> bool:
        """Whether the kernels keep this tensor in its blocks, and it is of type qtype (None: any
        type they keep): the integer-code types, and under the blocks backend F16 and BF16 too."""
        kind = self._tensor(name).tensor_type if self._kernels is not None else None
        kept = kind in SUPPORTED or (self._blocks and kind in SIXTEEN_BIT)
        return kind is not None and (kind == qtype if qtype is not None else kept)

    def embedding(self, name: str, shape: tuple[int, int]) -> F32 | QuantEmbedding:
        """The token embedding [V, H]: its blocks kept when the kernels keep weights quantized (F16
        and BF16 as their 16-bit values under the blocks backend)."""
        tensor = self._tensor(name)
        if self.keeps_blocks(name):
            try:
                if tensor.tensor_type not in SIXTEEN_BIT:
                    check_blocks(tensor.data, tensor.tensor_type, shape)
                elif tensor.data.nbytes != shape[0] * shape[1] * 2:
                    raise ValueError(f"is not a [{shape[0]}, {shape[1]}] matrix")
            except ValueError as exc:
                raise ModelLoadError(f"{self._model_name}: tensor {name!r}: {exc}") from exc
            return QuantEmbedding(as_blocks(tensor.data, shape[0]), tensor.tensor_type, shape, copy=not self._blocks)
        return self.owned(name, shape)

    def _tensor(self, name: str) -> Any:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} is missing")
        return tensor

    @property
    def blocks(self) -> bool:
        """Whether the matrices are read from the file's blocks in place (the `blocks` backend)."""
        return self._blocks

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name).shape)

    def load(self, name: str, shape: tuple[int, ...]) -> F32:
        """The tensor as float32 in numpy order ([out, in] for matrices); may view the file."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} is missing")
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            kind = getattr(tensor.tensor_type, "name", tensor.tensor_type)
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} has unsupported type {kind}") from exc
        if array.shape != shape:
            raise ModelLoadError(f"{self._model_name}: tensor {name!r} has shape {array.shape}, expected {shape}")
        return array.astype(np.float32, copy=False)

    def owned(self, name: str, shape: tuple[int, ...]) -> F32:
        """Like load, but never a view of the file, so the mapping can close."""
        array = self.load(name, shape)
        tensor = self._tensors[name]
        if np.may_share_memory(array, tensor.data) or not array.flags.c_contiguous:
            array = np.array(array, dtype=np.float32, order="C")
        return array

    def fused(self, names: list[str], shapes: list[tuple[int, int]], orders: list[I64 | None] | None = None) -> F32:
        """Stack [out_i, in] matrices side by side, transposed: [in, sum(out_i)], C-contiguous; rows
        reordered as in matrix()."""
        width = shapes[0][1]
        orders = orders or [None] * len(names)
        num_rows = [shape[0] if order is None else len(order) for shape, order in zip(shapes, orders, strict=True)]
        out = np.empty((width, sum(num_rows)), dtype=np.float32)                     # [in, out]
        col = 0
        for name, shape, order, n in zip(names, shapes, orders, num_rows, strict=True):
            w = self.load(name, shape)                             # one dequantized temporary at a time
            out[:, col:col + n] = (w if order is None else w[order]).T
            col += n
        return out


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
