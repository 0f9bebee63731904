"""What the forward multiplies by: a dense float32 matrix, or a kernel that holds one in its own
form (forge.kernels). The loader (forge.models.llama.weights) makes them; forge.models.llama.linear multiplies
by them; neither needs the other to say what a weight is."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


class LinearKernel(Protocol):
    """A weight matrix held by a kernel (forge.kernels): matmul(x) = x @ W, W of shape [in, out]."""
    nbytes: int

    @property
    def shape(self) -> tuple[int, int]: ...

    def matmul(self, x: F32) -> F32: ...


class PoolKernel(LinearKernel, Protocol):
    """A kernel whose products of dense_rows rows and more run on the engine's MatmulPool, each
    thread taking a range of output columns (forge.kernels.onnx_linear on the AMX tiles)."""
    dense_rows: int | None

    def split_rows(self, x: F32) -> Any: ...

    def column_cuts(self, num_parts: int) -> list[tuple[int, int]]: ...

    def dense_into(self, xs: Any, out: F32, cut: tuple[int, int]) -> None: ...


Weight = F32 | LinearKernel     # what forge.models.llama.linear.matmul(x, w) multiplies by
