"""x @ W.T over quantized weights with onnxruntime's MatMulNBits, the weights kept in 4-bit planes.

MatMulNBits' fast CPU path (MLAS) takes 4-bit codes with the default zero point 8 and one float
scale per block: w = scale * (q4 - 8). Any affine block format (forge.kernels.quant_blocks: w = s * q +
o, q of up to 8 bits) is written exactly as a sum of such planes plus a per-block offset:

    q = sum_p 16**p * n_p            (n_p: the p-th nibble of q)
    w = sum_p (16**p s) * (n_p - 8)  +  (o + 8 s sum_p 16**p)

so y = x @ W.T = sum_p MatMulNBits_p(x) + blocksum(x) @ offset'.T, where blocksum(x) [T, K/bs]
sums x over each block. The offset term is a small dense product (K/bs rows, not K). All of it
is one onnxruntime graph per weight. Arithmetic is float32 with float32 accumulation
(accuracy_level 1) unless the caller asks for int8 activations (accuracy_level 4, `fast`).

With `amx` (forge.kernels.compiled, amx_gemm.c), steps of DENSE_MIN_ROWS rows and more skip
onnxruntime: the same planes are widened panel by panel into bfloat16 halves and multiplied on the
CPU's AMX tiles in bfloat16x3 (~1e-5 relative to the float32 product); the matmul pool's threads
take ranges of output columns (split_rows, column_cuts, dense_into).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from forge.kernels import products
from forge.kernels.quant_blocks import AffineBlocks

F32 = npt.NDArray[np.float32]

ACCURACY_FP32 = 1     # float32 activations and accumulation
ACCURACY_INT8 = 4     # activations quantized to int8 per block (what llama.cpp does): faster, less exact
_IR_VERSION = 10      # onnxruntime 1.31 reads IR versions up to 13; 10 is what opset 21 needs


def session_options(num_threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # Outputs are allocated per call: an arena per session would hold each weight's largest
    # output (hundreds of sessions, each growing to the biggest step it has seen).
    options.enable_cpu_mem_arena = False
    # Nor memory patterns: a session records one per input shape it meets and keeps them all, and
    # a step's row count changes nearly every step, so over hours the patterns of hundreds of
    # sessions grew the daemon's RSS without bound (a 10-minute soak: 1.8 -> 4.6 GB; without them
    # RSS stays flat, docs/reliability.md). They bought no speed here (docs/benchmarks.md).
    options.enable_mem_pattern = False
    # Spinning threads would keep cores busy between the engine's many short calls, taking them
    # from attention and from the next call's own threads.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _planes(parts: list[AffineBlocks]) -> tuple[list[npt.NDArray[np.uint8]], list[F32], F32, int, F32, F32]:
    """The parts stacked along rows, as 4-bit planes packed for MatMulNBits ([N, K/bs, bs/2] each),
    their scales ([N * K/bs] each), the offset' matrix [K/bs, N], the common block size, and the
    blocks' own scale and offset [N, K/bs]."""
    bs = min(p.block_size for p in parts)
    num_planes = -(-max(p.bits for p in parts) // 4)
    same = [p.with_block_size(bs) for p in parts]
    codes = np.concatenate([p.codes for p in same], axis=0)                        # [N, K]
    scale = np.concatenate([p.scale for p in same], axis=0)                        # [N, K/bs]
    offset = np.concatenate([p.offset for p in same], axis=0)                      # [N, K/bs]
    n, k = codes.shape
    packed, scales = [], []
    for p in range(num_planes):
        nib = (codes >> (4 * p)) & 0x0F                                            # [N, K]
        packed.append((nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // bs, bs // 2))
        scales.append((scale * np.float32(16 ** p)).reshape(-1))
    with np.errstate(all="ignore"):       # inf/NaN scales stay inf/NaN, as in the reference
        shifted = offset + scale * np.float32(8 * sum(16 ** p for p in range(num_planes)))
    return (packed, scales, np.ascontiguousarray(shifted.T), bs, np.ascontiguousarray(scale),
            np.ascontiguousarray(offset))


class OnnxLinear:
    """y [T, N] = x [T, K] @ W.T, W [N, K] the row-wise concatenation of `parts` (one fused matrix:
    q/k/v, or gate/up). Thread-safe: onnxruntime sessions may run concurrently."""

    def __init__(self, parts: list[AffineBlocks], *, num_threads: int, accuracy_level: int = ACCURACY_FP32,
                 amx: bool = False) -> None:
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]
        if any(p.shape[1] != self.in_features for p in parts):
            raise ValueError("fused parts must share their input size")
        packed, scales, offset, bs, self._scale, self._offset = _planes(parts)
        self.num_planes, self.block_size = len(packed), bs
        self.nbytes = sum(a.nbytes for a in packed) + sum(s.nbytes for s in scales) + offset.nbytes
        model = _graph(packed, scales, offset, self.in_features, self.out_features, bs, accuracy_level)
        self._session = ort.InferenceSession(model.SerializeToString(), session_options(num_threads),
                                             providers=["CPUExecutionProvider"])
        # With amx, big steps multiply on the AMX tiles (forge.kernels.compiled: bfloat16x3, float32
        # accuracy; not under int8 activations). They widen from the planes, scales and offsets
        # kept here: about the planes' size again, since onnxruntime holds its own packed copy and
        # frees the one it was given.
        amx = (amx and accuracy_level == ACCURACY_FP32 and self.in_features % products.AMX_ROWS == 0
               and self.out_features % products.AMX_COLS == 0 and products.amx_ready())
        self.dense_rows = DENSE_MIN_ROWS if amx else None
        self._planes = packed if amx else []
        if not amx:
            self._scale = self._offset = np.empty((0, 0), dtype=np.float32)
        self.nbytes += sum(a.nbytes for a in self._planes) + self._scale.nbytes + self._offset.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        """[in, out], as the dense weights the model multiplies by on the right."""
        return self.in_features, self.out_features

    def matmul(self, x: F32) -> F32:
        """x [T, K] -> [T, N] float32: on the calling thread's AMX tiles from dense_rows rows,
        else on onnxruntime's threads."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.dense_rows is not None and x.shape[0] >= self.dense_rows:
            out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
            self.dense_into(self.split_rows(x), out, (0, self.out_features))
            return out
        y: F32 = self._session.run(None, {"x": x})[0]
        return y

    def split_rows(self, x: F32) -> SplitRows:
        """x [T, K] as its bfloat16 halves, ready for dense_into (shared by the threads of a split;
        split on the calling thread: on two it was slower, a hand-off costing more than the pass)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        m_pad = -(-x.shape[0] // products.AMX_ROWS) * products.AMX_ROWS
        hi = np.empty((m_pad, x.shape[1]), dtype=np.uint16)
        lo = np.empty_like(hi)
        products.amx_split_rows(x, hi, lo)
        return SplitRows(hi, lo, x.shape[0])

    def column_cuts(self, num_parts: int) -> list[tuple[int, int]]:
        """The output columns in num_parts ranges for dense_into, whole panels each."""
        panels = self.out_features // products.AMX_COLS
        bounds = [round(panels * i / num_parts) * products.AMX_COLS for i in range(num_parts + 1)]
        return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]

    def dense_into(self, xs: SplitRows, out: F32, cut: tuple[int, int]) -> None:
        """out[:, lo:hi] = x @ W[:, lo:hi] on the calling thread's AMX tiles (bfloat16x3, each panel
        of columns widened from the planes as it is reached). out C-contiguous float32 [T, N]."""
        products.amx_gemm_planes(xs.hi, xs.lo, xs.num_rows, self._planes, self._scale, self._offset, out, *cut)


class SplitRows(NamedTuple):
    hi: npt.NDArray[np.uint16]
    lo: npt.NDArray[np.uint16]
    num_rows: int


# Steps of at least this many rows multiply on the AMX tiles (where the host has them): there the
# bfloat16x3 product, widening the weights as it goes, beats onnxruntime's float32 4-bit product
# (all layers: 1.21x at 64 rows, 1.98x at 512, `scripts/ab/ab_kernels.py --kernels onnxruntime,amx`;
# decode steps of 64-96 sequences 6-10% faster, `scripts/ab/profile_step.py`; docs/benchmarks.md).
DENSE_MIN_ROWS = 64


def _graph(packed: list[npt.NDArray[np.uint8]], scales: list[F32], offset: F32, k: int, n: int, bs: int,
           accuracy_level: int) -> onnx.ModelProto:
    nodes, inits, terms = [], [], []
    for p, (b, s) in enumerate(zip(packed, scales, strict=True)):
        inits += [numpy_helper.from_array(b, f"b{p}"), numpy_helper.from_array(s, f"s{p}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"b{p}", f"s{p}"], [f"y{p}"], domain="com.microsoft",
                                      K=k, N=n, bits=4, block_size=bs, accuracy_level=accuracy_level))
        terms.append(f"y{p}")
    if np.any(offset):
        inits += [numpy_helper.from_array(np.array([-1, k // bs, bs], dtype=np.int64), "blocks"),
                  numpy_helper.from_array(np.array([2], dtype=np.int64), "last"),
                  numpy_helper.from_array(offset, "offset")]
        nodes += [helper.make_node("Reshape", ["x", "blocks"], ["xb"]),                # [T, K/bs, bs]
                  helper.make_node("ReduceSum", ["xb", "last"], ["xs"], keepdims=0),  # [T, K/bs]
                  helper.make_node("MatMul", ["xs", "offset"], ["yo"])]               # [T, N]
        terms.append("yo")
    total = terms[0]
    for i, term in enumerate(terms[1:]):
        nodes.append(helper.make_node("Add", [total, term], [f"sum{i}"]))
        total = f"sum{i}"
    nodes.append(helper.make_node("Identity", [total], ["y"]))
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])], inits)
    return helper.make_model(graph, ir_version=_IR_VERSION,
                             opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
