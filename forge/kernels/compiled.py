"""forge's own compiled kernels: C sources in this package, built for the host on first use.

The shared library is compiled with the host's C compiler (`cc`, or $CC) for the CPU it runs on
(-march=native) into $FORGE_HOME/kernels/, named by a hash of the sources, the flags, the compiler
and the CPU (a library built for one CPU may not run on another that shares the cache), and loaded
with ctypes (whose foreign calls release the GIL, so pool threads run in parallel). With no compiler
or a failed build the library is None and callers use their numpy path; `status()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

from forge.models.hub import forge_home

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]

# Every C file here is built into the library, named by a hash of them all (headers too): any change rebuilds it.
SOURCES = sorted(Path(__file__).parent.glob("*.c"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
# -ffast-math lets the compiler vectorise the exponentials (glibc's libmvec) and reorder the sums of
# the dot products, as BLAS does; scores stay finite (every row sees at least one key). It applies
# to compiling only: linking with it would add crtfastmath.o, which sets flush-to-zero for the whole
# process when the library loads (denormals would read as 0 in numpy and msgspec alike).
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11"]
LDFLAGS = ["-shared"]
# Files whose float arithmetic must stay as written: the deterministic numerics' product defines its
# result by the order and roundings of its operations (qmatmul_det.c), which -ffast-math would let the
# compiler regroup and -ffp-contract would fuse into multiply-adds (on some builds and not others).
EXACT_FLAGS = ["-fno-fast-math", "-ffp-contract=off"]
FILE_FLAGS = {"qmatmul_det.c": EXACT_FLAGS, "det_rowwise.c": EXACT_FLAGS, "det_attention.c": EXACT_FLAGS}

# Instruction-set levels the kernels can be built for, as flags added to -march=native: "native"
# is everything the host has (AVX-512 paths where it has AVX-512F, AMX tiles where it has them);
# "avx512" takes the AMX tiles away, "avx2" and "baseline" the wider vector sets too, so a host can
# run (and the tests check) the code a smaller CPU would get. FORGE_KERNEL_ISA picks the level the
# process runs (default native; avx512 is how an AMX host measures the path other CPUs take).
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISA_FLAGS = {"native": [], "avx512": NO_AMX, "avx2": [*NO_AMX, "-mno-avx512f", "-mno-avxvnni"],
             "baseline": [*NO_AMX, "-mno-avx512f", "-mno-avx2", "-mno-fma"]}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status = "not built yet"
_other_levels: dict[str, ctypes.CDLL] = {}


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first call; None when they cannot be had here."""
    global _library, _status
    with _lock:
        if _status == "not built yet":
            isa = os.environ.get("FORGE_KERNEL_ISA", "native")
            try:
                if isa not in ISA_FLAGS:
                    raise RuntimeError(f"FORGE_KERNEL_ISA={isa!r} is not one of {', '.join(ISA_FLAGS)}")
                _library = _load(isa)
                _status = "compiled" if isa == "native" else f"compiled ({isa})"
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _library, _status = None, f"unavailable ({exc})"
        return _library


def library_at(isa: str) -> ctypes.CDLL:
    """The kernels built for instruction-set level `isa` (ISA_FLAGS), beside the process's own:
    for tests that check each level the host can run. Raises RuntimeError when it cannot be built."""
    with _lock:
        if isa not in _other_levels:
            _other_levels[isa] = _load(isa)
        return _other_levels[isa]


def status() -> str:
    return _status


def _load(isa: str = "native") -> ctypes.CDLL:
    if os.environ.get("FORGE_NO_COMPILED_KERNELS"):
        raise RuntimeError("FORGE_NO_COMPILED_KERNELS is set")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    cflags = CFLAGS + ISA_FLAGS[isa]
    flags = " ".join(cflags + LDFLAGS + [f"{f}:{' '.join(v)}" for f, v in sorted(FILE_FLAGS.items())]).encode()
    text = b"".join(s.read_bytes() for s in SOURCES + HEADERS)
    key = hashlib.sha256(text + flags + version.encode() + _cpu_identity()).hexdigest()[:16]
    target = forge_home() / "kernels" / f"forge-kernels-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            objects = [str(Path(tmp) / f"{s.stem}.o") for s in SOURCES]
            built = Path(tmp) / target.name
            commands = [[compiler, *cflags, *FILE_FLAGS.get(s.name, []), "-c", "-o", obj, str(s)]
                        for s, obj in zip(SOURCES, objects, strict=True)]
            commands.append([compiler, *LDFLAGS, "-o", str(built), *objects, "-lm", "-lpthread"])
            for command in commands:
                result = subprocess.run(command, capture_output=True, text=True, timeout=120)
                if result.returncode != 0:
                    raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-400:]}")
            os.replace(built, target)              # atomic: a concurrent build loses nothing
    lib = ctypes.CDLL(str(target))
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    for name in [*_DECODE_BY_STORAGE.values(), *(n.replace("attention_", "attention_pool_")
                                                  for n in _DECODE_BY_STORAGE.values())]:
        fn = getattr(lib, name)
        fn.argtypes = [p, p, p, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float, p, p, p]
        fn.restype = ctypes.c_int
    lib.forge_decode_by_position.argtypes = [i64]
    lib.forge_decode_by_position.restype = i64
    lib.q8_0_matmul.argtypes = [p, i64, i64, p, i64, i64, i64, p]
    lib.q8_0_matmul.restype = ctypes.c_int
    for name, args in (("amx_split_rows", [p, i64, i64, i64, p, p]),
                       ("amx_gemm_planes", [p, p, i64, i64, i64, p, i64, p, p, i64, i64, i64, p, i64])):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    lib.paged_prefill_attention.argtypes = [p, p, p, p, p, ctypes.c_int, p, i64, p, p, p, p, i64, i64, i64, i64, i64,
                                            i64, p, i64, p, ctypes.c_int, p]
    lib.paged_prefill_attention.restype = ctypes.c_int
    lib.paged_prefill_attention_supports.argtypes = [i64]
    lib.paged_prefill_attention_supports.restype = ctypes.c_int
    for name, args in (("forge_rms_norm", [p, i64, i64, i64, p, ctypes.c_float, p, i64]),
                       ("forge_swiglu", [p, i64, i64, p]), ("forge_gelu_erf", [p, i64, p]),
                       ("forge_kv_store", [p, i64, i64, i64, p, p, p, ctypes.c_int]),
                       ("forge_hadamard32", [p, i64, ctypes.c_float]), ("forge_pool_park", [])):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    lib.amx_enable.argtypes = []
    lib.amx_enable.restype = ctypes.c_int
    lib.forge_qmatmul.argtypes = [p, i64, i64, i64, p, i64, p, i64, i64]
    lib.forge_qmatmul.restype = ctypes.c_int
    lib.forge_qmatmul_det.argtypes = [p, i64, i64, i64, p, i64, p, i64]
    lib.forge_qmatmul_det.restype = ctypes.c_int
    lib.forge_det_quantize.argtypes = [p, i64, i64, i64, p, p, p, p]
    lib.forge_det_quantize.restype = ctypes.c_int
    for name, args in (("forge_det_exp", [p, i64, p]), ("forge_det_log", [p, i64, p]), ("forge_det_tanh", [p, i64, p]),
                       ("forge_det_rms_norm", [p, i64, i64, i64, i64, i64, p, ctypes.c_float, p, i64, i64]),
                       ("forge_det_gated", [p, i64, i64, i64, p]), ("forge_det_logsumexp", [p, i64, i64, i64, p]),
                       ("forge_det_softmax", [p, i64, i64, i64, p]),
                       ("forge_det_matmul_f32", [p, i64, i64, p, i64, p])):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
    lib.forge_det_attention.argtypes = [p, p, p, ctypes.c_int, p, i64, p, i64, i64, i64, i64, i64, i64,
                                        ctypes.c_float, p, p, ctypes.c_int]
    lib.forge_det_attention.restype = ctypes.c_int
    lib.forge_qmatmul_det_type.argtypes = [i64]
    lib.forge_qmatmul_det_type.restype = ctypes.c_int
    lib.forge_det_pack_bytes.argtypes = [i64, i64, i64]
    lib.forge_det_pack_bytes.restype = i64
    lib.forge_det_pack.argtypes = [i64, p, i64, i64, p]
    lib.forge_det_pack.restype = ctypes.c_int
    lib.forge_moe_matmul.argtypes = [p, i64, i64, p, p, i64, p, i64, p, i64, i64]
    lib.forge_moe_matmul.restype = ctypes.c_int
    lib.forge_dequant_rows.argtypes = [p, i64, i64, p, i64, p]
    lib.forge_dequant_rows.restype = ctypes.c_int
    lib.forge_pool_threads.argtypes = [ctypes.c_int, i64]
    lib.forge_pool_threads.restype = ctypes.c_int
    lib.forge_parallel_copy.argtypes = [p, p, i64]
    lib.forge_parallel_copy.restype = None
    for name, restype in (("lanes", ctypes.c_int), ("fast", ctypes.c_int), ("amx", ctypes.c_int),
                          ("int8_rows", ctypes.c_int), ("int8_k_rows", i64), ("int8_k_split", i64),
                          ("bf16_split", i64)):
        query = getattr(lib, f"forge_qmatmul_{name}")     # what the build has: no arguments
        query.argtypes, query.restype = [], restype
    return lib


# The kernel for each storage type of the K/V cache (forge.models.llama.kv_dtype: uint16 is bfloat16).
_DECODE_BY_STORAGE = {np.dtype(np.float32): "paged_decode_attention_f32",
                      np.dtype(np.float16): "paged_decode_attention_f16",
                      np.dtype(np.uint16): "paged_decode_attention_bf16",
                      np.dtype(np.int8): "paged_decode_attention_i8"}


def _cpu_identity() -> bytes:
    """The CPU's model and feature flags (what -march=native compiles for); Linux's /proc/cpuinfo."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


# A step passes about a thousand arrays to the kernels. numpy's PyArrayObject holds the data pointer
# right after the object header (reference count, type): read there, a quarter of a.ctypes.data's
# cost (a helper object per call); where the layout differs (a free-threaded Python), a.ctypes.data.
_HEADER = 2 * ctypes.sizeof(ctypes.c_void_p)


def _data_at(a: npt.NDArray[np.generic]) -> int:
    return ctypes.c_void_p.from_address(id(a) + _HEADER).value or 0


_probe = np.arange(6, dtype=np.float32)[2:]
ptr = _data_at if _data_at(_probe) == _probe.ctypes.data else (lambda a: int(a.ctypes.data))


def paged_decode_attention(q: F32, k_cache: npt.NDArray[np.generic], v_cache: npt.NDArray[np.generic],
                           rows: I64, block_tables: I64,
                           context_lens: I64, scratch: F32, out: F32, first_keys: I64 | None = None,
                           softcap: float = 0.0, on_pool: bool = False, scales: KVScales | None = None,
                           lib: ctypes.CDLL | None = None, sinks: F32 | None = None) -> None:
    """Decode attention of `rows` (one query each) into out[rows]: see paged_attention.c. With
    first_keys [S], row s sees keys first_keys[s] .. context_lens[s] - 1 only (a sliding window);
    with softcap > 0, scores are soft-capped (softcap * tanh(score / softcap)) first; with sinks
    [nh], each head's logit joins its softmax's denominator (gpt-oss). `on_pool`:
    the (row, KV head) pairs split over the compiled products' threads (pool_threads), each on
    its own scores buffer (scratch unused), so one sequence's heads run in parallel too.

    q, out [T, nh, hd] float32; k_cache, v_cache [num_blocks, block_size, nkv, hd] float32, float16,
    bfloat16 (uint16 bits) or int8 with `scales` (the K and V scales, forge.models.llama.kv_dtype);
    rows [S]; block_tables [S, W]; context_lens [S]; scratch at least
    group * max(context_lens) floats. Every array C-contiguous with the dtypes above (checked: a
    wrong one would read stray memory). `lib`: another level's build (library_at), else the
    process's.
    """
    lib = lib or library()
    assert lib is not None, "paged_decode_attention called without the compiled kernels"
    kernel = _DECODE_BY_STORAGE.get(k_cache.dtype)
    if kernel is None or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"no paged_decode_attention for a {k_cache.dtype} / {v_cache.dtype} cache")
    check("paged_decode_attention", q, np.float32, k_cache, k_cache.dtype, v_cache, k_cache.dtype, rows, np.int64,
           block_tables, np.int64, context_lens, np.int64, scratch, np.float32, out, np.float32,
           *((first_keys, np.int64) if first_keys is not None else ()))
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if not on_pool and len(rows) and scratch.size < group * int(context_lens.max()):
        raise ValueError("scratch too small for the longest context")
    if first_keys is not None and (first_keys.shape != rows.shape or np.any(first_keys < 0)
                                   or np.any(first_keys >= context_lens)):
        raise ValueError("first_keys must give each row a first key in [0, its context length)")
    k_scales, v_scales = scale_pointers("paged_decode_attention", k_cache, scales)
    if on_pool:
        kernel = kernel.replace("attention_", "attention_pool_")
    rc = getattr(lib, kernel)(
        ptr(q), ptr(k_cache), ptr(v_cache), k_scales, v_scales, ptr(rows), ptr(block_tables),
        block_tables.shape[1],
        ptr(context_lens), None if first_keys is None else ptr(first_keys), len(rows),
        num_heads, num_kv_heads, head_dim, block_size, softcap, sinks_at(sinks, num_heads), ptr(scratch), ptr(out))
    if rc == -2:
        raise MemoryError("paged_decode_attention: no memory for a thread's scores")
    if rc != 0:
        raise ValueError(f"paged_decode_attention: {group} query heads per KV head or head_dim {head_dim} "
                         "is beyond the kernel's limits (64, 256)")


def decode_by_position(heads: int, lib: ctypes.CDLL | None = None) -> int:
    """Sequences with at least `heads` KV heads of one query head each (MHA) decode position by position
    (paged_attention.c's decode_heads_: every head of 16 keys at a time, reading each block's rows in
    one stretch) rather than head by head; the default is 8. Returns the previous threshold; a huge value
    keeps every sequence head by head (the same results, bit for bit: the tests compare them)."""
    lib = lib or library()
    assert lib is not None, "decode_by_position called without the compiled kernels"
    return int(lib.forge_decode_by_position(heads))


def rms_norm(x: F32, weight: F32, eps: float, out: F32) -> None:
    """out[i] = x[i] * weight / rms(x[i]) for the rows of x [n, H] (rows may be strided, e.g. a row
    range of a wider array's view; the last axis contiguous); out C-contiguous [n, H]. See
    elementwise.c; forge.models.llama.llama_model.rms_norm is the reference."""
    lib = library()
    assert lib is not None, "rms_norm called without the compiled kernels"
    n, h = x.shape
    if (x.dtype != np.float32 or weight.dtype != np.float32 or out.dtype != np.float32 or x.strides[1] != 4
            or weight.shape != (h,) or not weight.flags.c_contiguous or out.shape != (n, h)
            or not out.flags.c_contiguous):
        raise ValueError("rms_norm needs float32 x [n, H] with contiguous rows, weight [H] and out [n, H]")
    lib.forge_rms_norm(ptr(x), n, h, x.strides[0] // 4, ptr(weight), eps, ptr(out), h)


def swiglu(gate_up: F32, out: F32) -> None:
    """out = SiLU(gate) * up for gate_up = [gate | up] [n, 2F] C-contiguous; out C-contiguous [n, F].
    See elementwise.c; forge.models.llama.llama_model.swiglu is the reference."""
    lib = library()
    assert lib is not None, "swiglu called without the compiled kernels"
    n, two_f = gate_up.shape
    check("swiglu", gate_up, np.float32, out, np.float32)
    if two_f % 2 or out.shape != (n, two_f // 2):
        raise ValueError("swiglu needs gate_up [n, 2F] and out [n, F]")
    lib.forge_swiglu(ptr(gate_up), n, two_f // 2, ptr(out))


def gelu_erf(x: F32, out: F32) -> None:
    """out = x * Phi(x), the exact GELU, for C-contiguous float32 x and out of one shape (out may be x).
    See elementwise.c; forge.models.bert.bert_model.gelu is the reference."""
    lib = library()
    assert lib is not None, "gelu_erf called without the compiled kernels"
    check("gelu_erf", x, np.float32, out, np.float32)
    if out.shape != x.shape:
        raise ValueError("gelu_erf needs x and out of one shape")
    lib.forge_gelu_erf(ptr(x), x.size, ptr(out))


KV_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.uint16): 2, np.dtype(np.int8): 3}
INT8_GROUP = 32             # values per scale of an int8 cache (kv16.h's KV_INT8_GROUP)
KVScales = tuple[npt.NDArray[np.float16], npt.NDArray[np.float16]]   # an int8 cache's K and V scales


def scale_pointers(name: str, k_cache: npt.NDArray[np.generic],
                    scales: KVScales | None) -> tuple[int | None, int | None]:
    """An int8 cache's scale arrays as pointers (checked: C-contiguous float16 [..., head_dim / 32]
    beside the values), or None, None for the other storage types (which take none)."""
    if k_cache.dtype != np.int8:
        if scales is not None:
            raise ValueError(f"{name}: scales given for a {k_cache.dtype} cache")
        return None, None
    if scales is None:
        raise ValueError(f"{name}: an int8 cache needs its scales")
    want = (*k_cache.shape[:-1], k_cache.shape[-1] // INT8_GROUP)
    for s in scales:
        if s.dtype != np.float16 or s.shape != want or not s.flags.c_contiguous or k_cache.shape[-1] % INT8_GROUP:
            raise ValueError(f"{name}: int8 scales must be C-contiguous float16 {want}")
    return ptr(scales[0]), ptr(scales[1])


def hadamard32_(x: F32, scale: float) -> None:
    """In place: each run y of 32 values of x (C-contiguous float32, size a multiple of 32) <- H y *
    scale, H the unnormalised 32 x 32 Walsh-Hadamard matrix (elementwise.c; forge.models.llama.kv_dtype.
    hadamard32 is its reference, the same bits)."""
    lib = library()
    assert lib is not None, "hadamard32_ called without the compiled kernels"
    if x.dtype != np.float32 or not x.flags.c_contiguous or x.size % INT8_GROUP:
        raise ValueError("hadamard32_ needs C-contiguous float32 of a multiple of 32 values")
    lib.forge_hadamard32(ptr(x), x.size // INT8_GROUP, scale)


def kv_store(x: F32, slots: I64, values: npt.NDArray[np.generic], scales: npt.NDArray[np.float16] | None = None,
             *, trusted: bool = False) -> None:
    """Write rows x [T, nkv, hd] (float32; each row's [nkv, hd] contiguous, the rows any stride
    apart: a view of the projections' output) into the cache `values` [num_blocks, block_size, nkv,
    hd] at flat slots `slots` [T], in its storage type (float32, float16, bfloat16 bits, or int8
    with its `scales`), as forge.models.llama.kv_dtype writes them, bit for bit (elementwise.c's
    forge_kv_store). Checked, the slots too unless `trusted` (the model's forward, whose batch was
    checked before the step): a wrong one would write stray memory."""
    lib = library()
    assert lib is not None, "kv_store called without the compiled kernels"
    kv_type = KV_TYPE.get(values.dtype)
    row_len = math.prod(values.shape[2:])
    num_slots = values.shape[0] * values.shape[1]
    if (kv_type is None or x.dtype != np.float32 or x.ndim != 3 or x.shape[1:] != values.shape[2:]
            or x.strides[2] != 4 or x.strides[1] != 4 * x.shape[2] or x.strides[0] % 4 or x.strides[0] < 4 * row_len
            or not values.flags.c_contiguous or slots.dtype != np.int64 or slots.shape != (len(x),)
            or (kv_type == 3) != (scales is not None)
            or (scales is not None and (scales.dtype != np.float16 or not scales.flags.c_contiguous
                                        or row_len % INT8_GROUP or scales.size * INT8_GROUP != values.size))
            or (not trusted and len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= num_slots))):
        raise ValueError("kv_store needs float32 rows [T, nkv, hd] of contiguous rows, in-range int64 slots and a "
                         "C-contiguous cache (int8 with its float16 scales)")
    slots = np.ascontiguousarray(slots)
    lib.forge_kv_store(ptr(x), x.strides[0] // 4, len(x), row_len, ptr(slots), ptr(values),
                       None if scales is None else ptr(scales), kv_type)


def sinks_at(sinks: F32 | None, num_heads: int) -> int | None:
    """The attention sinks' pointer (checked: C-contiguous float32 [num_heads]), or None for none."""
    if sinks is not None and (sinks.dtype != np.float32 or sinks.shape != (num_heads,) or not sinks.flags.c_contiguous):
        raise ValueError(f"attention sinks must be C-contiguous float32 [{num_heads}]")
    return None if sinks is None else ptr(sinks)


def check(kernel: str, *pairs: object) -> None:
    """Every array C-contiguous with its dtype, (array, dtype, array, dtype, ...), before `kernel`
    reads them through raw pointers (a wrong one would read stray memory)."""
    for a, dtype in zip(pairs[::2], pairs[1::2], strict=True):
        assert isinstance(a, np.ndarray)
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{kernel} needs C-contiguous {np.dtype(dtype).name} arrays")  # type: ignore[call-overload]
