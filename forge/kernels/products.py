"""The compiled products' Python side: the tied Q8_0 head (q8_matmul.c), AMX tiles (amx_gemm.c), and
products straight from GGUF blocks (qmatmul.c; the deterministic numerics: qmatmul_det.c) with their
thread pool (pool.c). The library is built
and loaded by forge.kernels.compiled; every call here checks its arrays before C reads them.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import numpy.typing as npt

from forge.kernels.compiled import F32, I64, check, library, ptr

U16 = npt.NDArray[np.uint16]
I32 = npt.NDArray[np.int32]
_lock = threading.Lock()


Q8_0_BLOCK_BYTES = 34       # a float16 scale and 32 int8 values


def q8_0_matmul(x: F32, blocks: npt.NDArray[np.uint8], out: F32, v_lo: int, v_hi: int) -> None:
    """out[:, v_lo:v_hi] = x @ W[v_lo:v_hi].T for W [V, K] in Q8_0 blocks ([V, K / 32 * 34] bytes):
    see q8_matmul.c. x [T, K] and out [T, V] C-contiguous float32 (checked)."""
    lib = library()
    assert lib is not None, "q8_0_matmul called without the compiled kernels"
    num_rows, k = x.shape
    v_total = out.shape[1]
    if (x.dtype != np.float32 or out.dtype != np.float32 or blocks.dtype != np.uint8
            or not (x.flags.c_contiguous and out.flags.c_contiguous and blocks.flags.c_contiguous)):
        raise ValueError("q8_0_matmul needs C-contiguous float32 x and out and uint8 blocks")
    if (blocks.shape != (v_total, k // 32 * Q8_0_BLOCK_BYTES) or out.shape[0] != num_rows
            or not 0 <= v_lo <= v_hi <= v_total):
        raise ValueError(f"q8_0_matmul: shapes {x.shape}, {blocks.shape}, {out.shape} "
                         f"or range [{v_lo}, {v_hi}) disagree")
    rc = lib.q8_0_matmul(ptr(x), num_rows, k, ptr(blocks), v_lo, v_hi, v_total, ptr(out))
    if rc == -2:
        raise MemoryError(f"q8_0_matmul: no memory for its buffers of K={k}")
    if rc != 0:
        raise ValueError(f"q8_0_matmul: K={k} is not whole blocks of 32 or over 8192")



# ---- AMX (amx_gemm.c) ------------------------------------------------------------------------------

_amx: bool | None = None


def amx_ready() -> bool:
    """Whether the compiled kernels have AMX tiles and Linux lets this process use them (asked once)."""
    global _amx
    lib = library()
    with _lock:
        if _amx is None:
            _amx = lib is not None and lib.amx_enable() == 0
        return _amx


AMX_ROWS = 32      # activations are padded to a multiple of this many rows
AMX_COLS = 32      # weights are widened in panels of this many output columns


def amx_split_rows(x: F32, hi: U16, lo: U16) -> None:
    """x [m, k] float32 -> its bfloat16 halves hi, lo [m_pad, k] (m_pad a multiple of AMX_ROWS, the
    rows past m zero): see amx_gemm.c."""
    lib = _amx_library()
    m, k = x.shape
    check("amx_split_rows", x, np.float32, hi, np.uint16, lo, np.uint16)
    if hi.shape != lo.shape or hi.ndim != 2 or hi.shape[1] != k or hi.shape[0] < m:
        raise ValueError("amx_split_rows: shapes disagree")
    if lib.amx_split_rows(ptr(x), m, k, hi.shape[0], ptr(hi), ptr(lo)) != 0:
        raise ValueError(f"amx_split_rows: {hi.shape[0]} rows or k={k} not multiples of {AMX_ROWS}")


def amx_gemm_planes(ah: U16, al: U16, m: int, planes: list[npt.NDArray[np.uint8]], scale: F32, offset: F32,
                    out: F32, n_lo: int, n_hi: int) -> None:
    """out[:m, n_lo:n_hi] = x @ W[:, n_lo:n_hi] on the AMX tiles, in bfloat16x3 (~1e-5 relative to
    the float32 product): x as amx_split_rows left it in ah, al; W [K, N] the affine block matrix
    held as 4-bit `planes` ([N, K/bs, bs/2] each, as forge.kernels.onnx_linear packs them) with
    per-block `scale` and `offset` [N, K/bs]. out C-contiguous float32 [>= m, N]."""
    lib = _amx_library()
    m_pad, k = ah.shape
    num_rows, num_blocks = scale.shape
    half = planes[0].shape[2] if planes and planes[0].ndim == 3 else 0
    check("amx_gemm_planes", ah, np.uint16, al, np.uint16, out, np.float32, scale, np.float32, offset, np.float32,
           *[a for q in planes for a in (q, np.uint8)])
    if (al.shape != ah.shape or not planes or any(q.shape != (num_rows, num_blocks, half) for q in planes)
            or offset.shape != scale.shape or num_blocks * half * 2 != k or out.ndim != 2 or out.shape[1] != num_rows
            or out.shape[0] < m or m > m_pad or not 0 <= n_lo <= n_hi <= num_rows):
        raise ValueError("amx_gemm_planes: shapes or column range disagree")
    pointers = (ctypes.c_void_p * len(planes))(*(ptr(q) for q in planes))
    rc = lib.amx_gemm_planes(ptr(ah), ptr(al), m, m_pad, k, ctypes.addressof(pointers), len(planes), ptr(scale),
                             ptr(offset), 2 * half, n_lo, n_hi, ptr(out) + 4 * n_lo, out.shape[1])
    if rc == -2:
        raise MemoryError("amx_gemm_planes: no memory for its panel buffers")
    if rc != 0:
        raise ValueError(f"amx_gemm_planes: {m_pad} rows, k={k}, block size {2 * half}, {len(planes)} planes or "
                         f"{n_hi - n_lo} columns beyond its limits")


def _amx_library() -> ctypes.CDLL:
    if not amx_ready():
        raise RuntimeError("the AMX kernels are not available on this host")
    lib = library()
    assert lib is not None
    return lib


# ---- products straight from GGUF blocks (qmatmul.c) -------------------------------------------------

# The ggml types qmatmul.c reads (gguf.constants.GGMLQuantizationType values).
FORGE_DET = 2               # forge_qmatmul's `fast` for the deterministic numerics (qmatmul.h)
QMATMUL_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30, 39})
DET_PACKED = 0x100          # a part's type flag: the deterministic product's own layout (qmatmul_det_pack.h)


class QPart(ctypes.Structure):
    """One part of a stacked weight, as qmatmul.h's qpart: the file's rows of blocks."""
    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64), ("type", ctypes.c_int64)]


def qparts(parts: list[tuple[npt.NDArray[np.uint8], int]]) -> ctypes.Array[QPart]:
    """The ctypes descriptor of (blocks [rows, bytes per row], ggml type) parts, stacked along rows.
    The arrays must outlive it (the caller keeps them)."""
    return qparts_rows([(blocks, qtype, blocks.shape[0]) for blocks, qtype in parts])


def _check_product(name: str, x: F32, k: int, out: F32) -> None:
    """x [T, k] and out [T, N]: C-contiguous float32 of agreeing shapes (ValueError otherwise)."""
    check(name, x, np.float32, out, np.float32)
    if x.ndim != 2 or x.shape[1] != k or out.ndim != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: x {x.shape} or out {out.shape} disagree with K={k}")


def qmatmul(x: F32, k: int, descriptor: ctypes.Array[QPart], out: F32, lib: ctypes.CDLL | None = None,
            fast: bool = False) -> None:
    """out [T, N] = x [T, k] @ W.T, W the parts of `descriptor` stacked (see qmatmul.c): float32
    activations and accumulation (`fast`: qmatmul_fast_kind()'s numerics, x and the weights rounded
    to bfloat16 or x as int8 codes per block of 32; only where it has one), on the kernel pool's threads. x and out
    C-contiguous float32. `lib`: another level's build (library_at), else the process's."""
    lib = lib or library()
    assert lib is not None, "qmatmul called without the compiled kernels"
    _check_product("qmatmul", x, k, out)
    rc = lib.forge_qmatmul(ptr(x), x.shape[0], k, k, ctypes.addressof(descriptor), len(descriptor), ptr(out),
                           out.shape[1], int(fast))
    if rc == -2:
        raise ValueError("qmatmul: this build has no fast numerics (AVX-512 BF16 or AVX2)")
    if rc == -3:
        raise MemoryError("qmatmul: no memory to round or quantize x")
    if rc != 0:
        raise ValueError(f"qmatmul: K={k} is not whole blocks of the parts' types, or too many parts")


def qmatmul_det(x: F32, k: int, descriptor: ctypes.Array[QPart], out: F32, lib: ctypes.CDLL | None = None) -> None:
    """out [T, N] = x [T, k] @ W.T in the deterministic numerics (qmatmul_det.c: x as int8 codes per block
    of 32, exact integer products, one fixed order of float32 roundings; the same bits on every build
    and for any batch), on the kernel pool's threads. x and out C-contiguous float32."""
    lib = lib or library()
    assert lib is not None, "qmatmul_det called without the compiled kernels"
    _check_product("qmatmul_det", x, k, out)
    rc = lib.forge_qmatmul_det(ptr(x), x.shape[0], k, k, ctypes.addressof(descriptor), len(descriptor), ptr(out),
                               out.shape[1])
    if rc == -3:
        raise MemoryError("qmatmul_det: no memory to quantize x")
    if rc != 0:
        raise ValueError(f"qmatmul_det: K={k} is not whole blocks of the parts' types, or a type it does not read")


def det_type(qtype: int, lib: ctypes.CDLL | None = None) -> bool:
    """Whether the deterministic product reads ggml type `qtype`."""
    lib = lib or library()
    return lib is not None and bool(lib.forge_qmatmul_det_type(qtype))


def det_pack(blocks: npt.NDArray[np.uint8], qtype: int, k: int,
             lib: ctypes.CDLL | None = None) -> tuple[npt.NDArray[np.uint8], int]:
    """A weight's blocks [rows, bytes] (ggml type qtype, k values a row) in the deterministic product's own
    layout (qmatmul_det_pack.h: 16 rows' codes side by side, the file's bytes, K-quants 2-3% more), with the type
    a part of it takes (qtype | DET_PACKED); the product of the packed part has the same bits. The result
    is [groups of 16 rows, bytes a group]: its rows are not the weight's."""
    lib = lib or library()
    assert lib is not None, "det_pack called without the compiled kernels"
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    rows = blocks.shape[0]
    size = int(lib.forge_det_pack_bytes(qtype, rows, k))
    if size < 0:
        raise ValueError(f"det_pack: type {qtype} or K={k} is not one the deterministic product reads")
    groups = -(-rows // 32) * 2
    out = np.empty((groups, size // groups), dtype=np.uint8)
    rc = lib.forge_det_pack(qtype, ptr(blocks), rows, k, ptr(out))
    if rc == -3:
        raise MemoryError("det_pack: no memory for its buffer")
    if rc != 0:
        raise ValueError(f"det_pack: type {qtype} or K={k} is not one the deterministic product reads")
    return out, qtype | DET_PACKED


def qparts_rows(parts: list[tuple[npt.NDArray[np.uint8], int, int]]) -> ctypes.Array[QPart]:
    """qparts() of parts whose arrays' rows are not the weight's (det_pack's groups): (array, type, rows)."""
    for blocks, qtype, _ in parts:
        if (blocks.dtype != np.uint8 or blocks.ndim != 2 or not blocks.flags.c_contiguous
                or qtype & ~DET_PACKED not in QMATMUL_TYPES):
            raise ValueError("qmatmul parts must be C-contiguous uint8 [rows, bytes] of a type it reads")
    return (QPart * len(parts))(*(QPart(ptr(b), rows, int(t)) for b, t, rows in parts))


def det_quantize(x: F32, lib: ctypes.CDLL | None = None) -> tuple[npt.NDArray[np.int16], F32, I32, I32]:
    """x [T, K] as the deterministic product quantizes it: 15-bit codes [T, K], scales and code sums
    [T, K / 32], half-block sums [T, K / 16]."""
    lib = lib or library()
    assert lib is not None, "det_quantize called without the compiled kernels"
    x = np.ascontiguousarray(x, dtype=np.float32)
    t, k = x.shape
    q = np.empty((t, k), dtype=np.int16)
    dx = np.empty((t, k // 32), dtype=np.float32)
    bsum = np.empty((t, k // 32), dtype=np.int32)
    hsum = np.empty((t, k // 16), dtype=np.int32)
    if lib.forge_det_quantize(ptr(x), t, k, k, ptr(q), ptr(dx), ptr(bsum), ptr(hsum)) != 0:
        raise ValueError(f"det_quantize: K={k} is not whole blocks of 32")
    return q, dx, bsum, hsum


def dequant_rows(blocks: npt.NDArray[np.uint8], qtype: int, k: int, rows: I64) -> F32:
    """Rows `rows` of a [R, k] matrix held as `blocks` (ggml type qtype), widened to float32 [n, k]
    exactly as qmatmul reads them."""
    lib = library()
    assert lib is not None, "dequant_rows called without the compiled kernels"
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if blocks.dtype != np.uint8 or not blocks.flags.c_contiguous or (len(rows) and (
            rows.min() < 0 or rows.max() >= blocks.shape[0])):
        raise ValueError("dequant_rows: rows outside the matrix, or blocks not C-contiguous uint8")
    out = np.empty((len(rows), k), dtype=np.float32)
    if lib.forge_dequant_rows(ptr(blocks), qtype, k, ptr(rows), len(rows), ptr(out)) != 0:
        raise ValueError(f"dequant_rows: type {qtype} or K={k} not read by qmatmul")
    return out


# Pause loops a pool worker spins after a job before it sleeps (FORGE_POOL_SPIN overrides): the
# next product of a step follows within microseconds, a futex wake-up costs tens of them.
POOL_SPIN = 20000


def pool_threads(num_threads: int, lib: ctypes.CDLL | None = None) -> int:
    """Size the compiled kernels' own thread pool (the calling thread counted); returns the count
    in force (1 without the compiled kernels)."""
    lib = lib or library()
    if lib is None:
        return 1
    spin = int(os.environ.get("FORGE_POOL_SPIN", POOL_SPIN))
    return int(lib.forge_pool_threads(num_threads, spin))


def pool_park() -> None:
    """The kernel pool's workers stop spinning and sleep until its next job (pool.c's
    forge_pool_park): before Python's own threads want the cores (a step's prompt attention on the
    MatmulPool's threads, the server's between steps). No-op without the compiled kernels."""
    lib = library()
    if lib is not None:
        lib.forge_pool_park()


def parallel_copy(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> None:
    """dst[...] = src on the kernel pool's threads (the benchmarks' memory-bandwidth probe)."""
    lib = library()
    assert lib is not None, "parallel_copy called without the compiled kernels"
    check("parallel_copy", dst, np.uint8, src, np.uint8)
    if dst.shape != src.shape:
        raise ValueError("parallel_copy: shapes differ")
    lib.forge_parallel_copy(ptr(dst), ptr(src), src.size)


FAST_KINDS = {0: "", 1: "bfloat16", 2: "int8", 3: "int8+bfloat16"}


def qmatmul_fast(lib: ctypes.CDLL | None = None) -> bool:
    """Whether qmatmul has the `fast` numerics here (qmatmul_fast_kind() is not "")."""
    return qmatmul_fast_kind(lib) != ""


def qmatmul_fast_kind(lib: ctypes.CDLL | None = None) -> str:
    """The `fast` numerics of qmatmul here: "bfloat16" (x and the widened weights rounded to
    bfloat16: built with AVX-512 BF16 but not VNNI), "int8" (x as int8 codes per superblock of 256
    for the K-quants, per block of 32 for Q4_0/Q4_1/Q8_0 and the table types IQ4_NL/IQ4_XS/MXFP4,
    integer products: an AVX2 build),
    "int8+bfloat16" (the K-quants' int8 products as in "int8", every other type's bfloat16: AVX-512
    with BW, VNNI and BF16), or "" (none: the baseline build, or AVX-512 without BF16)."""
    lib = lib or library()
    return "" if lib is None else FAST_KINDS[int(lib.forge_qmatmul_fast())]


def qmatmul_int8_rows(lib: ctypes.CDLL | None = None) -> int:
    """The most rows of a step in the fast numerics whose Q4_0, Q4_1, Q8_0, IQ4_NL, IQ4_XS and MXFP4
    products are int8 here (qmatmul.h's I8_MAX_ROWS: bigger steps take the float32 path, faster
    there; the K-quants' are int8 in every step), or 0 where none are."""
    lib = lib or library()
    return 0 if lib is None else int(lib.forge_qmatmul_int8_rows())


def qmatmul_int8_k_rows(lib: ctypes.CDLL | None = None) -> int:
    """The most rows of a step in the fast numerics whose K-quant (Q4_K, Q5_K, Q6_K) products are
    int8 here (2**63 - 1: every step, in an AVX2 or AVX-512 VNNI build), or 0 where none are."""
    lib = lib or library()
    return 0 if lib is None else int(lib.forge_qmatmul_int8_k_rows())


def qmatmul_int8_k_split(lib: ctypes.CDLL | None = None) -> int:
    """The most rows of a fast K-quant step that the decode kernels take here (qmatmul.h's
    I8K_MAX_ROWS), bigger steps going to the lanes-as-rows kernel (AVX-512 VNNI), which adds in
    another order: a row's bits differ across this bound. 0 where one kernel takes every step."""
    lib = lib or library()
    return 0 if lib is None else int(lib.forge_qmatmul_int8_k_split())


def qmatmul_bf16_split(lib: ctypes.CDLL | None = None) -> int:
    """The most rows of a fast bfloat16 step that the fused path takes here (qmatmul.h's
    FUSED_MAX_ROWS_BF16), bigger steps going to the lanes-as-rows kernel, which adds in another
    order: a row's bits differ across this bound. 0 where one order serves every step."""
    lib = lib or library()
    return 0 if lib is None else int(lib.forge_qmatmul_bf16_split())


def qmatmul_amx_rows(lib: ctypes.CDLL | None = None) -> int:
    """The fewest rows of a step in the fast numerics that run on the AMX tiles here (qmatmul.h's
    AMX_MIN_ROWS), or 0 where none do: the build has no tiles, or Linux does not allow them."""
    lib = lib or library()
    return 0 if lib is None else int(lib.forge_qmatmul_amx())


def qmatmul_lanes(lib: ctypes.CDLL | None = None) -> int:
    """The vector width qmatmul.c was built with on this host (16: AVX-512, 8: AVX2 or less)."""
    lib = lib or library()
    return 0 if lib is None else int(lib.forge_qmatmul_lanes())


def moe_matmul(x: F32, k: int, descriptor: ctypes.Array[QPart], num_experts: int, experts: I64, starts: I64,
               out: F32, fast: bool = False, lib: ctypes.CDLL | None = None, det: bool = False) -> None:
    """The grouped product of a mixture of experts (moe_matmul.c): out[starts[g]:starts[g + 1]] = those
    rows of x @ W_e.T for every group g, e = experts[g], W_e expert e's rows of the parts of
    `descriptor` stacked (each part's data: the 3-D tensor's start; rows: one expert's), all on the
    kernel pool's threads, each group the bits of one qmatmul of its rows. x [N, k] and out [N, out
    columns] C-contiguous float32; experts below num_experts, starts rising from 0 to N (checked).
    `lib`: another level's build (library_at), else the process's."""
    lib = lib or library()
    assert lib is not None, "moe_matmul called without the compiled kernels"
    check("moe_matmul", x, np.float32, out, np.float32, experts, np.int64, starts, np.int64)
    num_groups, num_rows = len(experts), x.shape[0]
    if x.ndim != 2 or x.shape[1] != k or out.ndim != 2 or out.shape[0] != num_rows or \
            out.shape[1] != sum(part.rows for part in descriptor):
        raise ValueError(f"moe_matmul: x {x.shape} or out {out.shape} disagree with K={k} or the parts")
    if starts.shape != (num_groups + 1,) or (num_groups and (
            starts[0] != 0 or starts[-1] != num_rows or np.any(np.diff(starts) < 0)
            or experts.min() < 0 or experts.max() >= num_experts)):
        raise ValueError("moe_matmul: experts outside the tensors, or starts not rising from 0 to the rows of x")
    rc = lib.forge_moe_matmul(ptr(x), k, k, ptr(experts), ptr(starts), num_groups, ctypes.addressof(descriptor),
                              len(descriptor), ptr(out), out.shape[1], FORGE_DET if det else int(fast))
    if rc == -2:
        raise ValueError("moe_matmul: this build has no fast numerics (AVX-512 BF16 or AVX2)")
    if rc == -3:
        raise MemoryError("moe_matmul: no memory to round or quantize x")
    if rc != 0:
        raise ValueError(f"moe_matmul: K={k} is not whole blocks of the parts' types, or too many parts")
