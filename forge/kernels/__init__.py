"""The kernel layer under the model: how a weight matrix is held and multiplied.

Backends, chosen once at load (`--kernels`):

    blocks       weights stay in the GGUF file's own blocks, read from its mapping (no copy), and
                 are multiplied by forge's compiled kernel (forge.kernels.quant_linear, qmatmul.c):
                 every weight widened in registers exactly as the file means it, float32
                 activations and accumulation, the same bits for a row whatever the batch. Every
                 x86-64 CPU (AVX-512 or AVX2 code, chosen when the kernels are built for the host).
    numpy        the reference: every weight dequantized once to float32, products by numpy/BLAS
                 (forge.models.llama.linear). Runs everywhere; 5x the GGUF's memory for 4-bit files.
    onnxruntime  weights stay in their GGUF blocks' integer codes, as 4-bit planes
                 (forge.kernels.onnx_linear): about the file's size in memory. float32 arithmetic
                 with float32 accumulation over exactly the file's values.
    amx          onnxruntime, and steps of many tokens (prefill) multiplied on the CPU's AMX tiles
                 in bfloat16x3 (forge.kernels.amx_gemm.c): about twice as fast there, ~1e-5
                 relative to the float32 product; the planes are kept once more for it (~0.6x the
                 file). Intel Sapphire Rapids and later, with Linux's permission.
    fast         onnxruntime with activations quantized to int8 per block (as llama.cpp does):
                 faster at a few tokens per step, agrees with the reference to ~1e-2 relative
                 (the same as --kernels onnxruntime --numerics fast).
    auto         blocks where the compiled kernels have AVX-512 (AMX hosts included: there blocks
                 decodes 1.6x faster than amx and keeps a row's bits whatever the batch; amx
                 prefills faster, so it stays for prompt-heavy loads by name), else onnxruntime
                 when it is installed (with AVX2 alone blocks decodes faster but prefills slower:
                 docs/benchmarks.md), else blocks, else numpy.

Numerics, chosen apart from the backend (`--numerics`, NUMERICS):

    deterministic  blocks only: x as int8 codes per block of 32, multiplied with the file's integer
                 codes in exact int32 sums, the blocks' float32 terms added in one fixed order
                 (qmatmul_det.c; forge.kernels.det_reference defines it in numpy): a product's bits
                 do not depend on the batch, the threads or the instruction set the kernels were
                 built for. Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; other types take the
                 reference product.

    reference    float32 activations and accumulation over exactly the file's weights (the
                 default: the greedy reference tests hold, a row's bits do not depend on the batch).
    fast         blocks: x and the widened weights rounded to bfloat16, float32 accumulation
                 (AVX-512 BF16's pair dot products: about twice the reference's prefill on an AMD
                 host, a few 1e-3 relative; where the CPU has AMX tiles, steps of 8+ rows multiply
                 the same values on them, 5-7x the prefill of the vector path there, and smaller
                 steps take the float32 path, faster there: a row's bits then differ between
                 steps below and above 8 rows); on an AVX2 host without AVX-512, x as int8
                 codes multiplied with the file's codes as integers (llama.cpp's way; ~1e-2
                 relative, as onnxruntime's int8): the K-quants in every step, x per
                 superblock of 256 (batch-invariant); Q4_0, Q4_1, Q8_0 and the table types
                 IQ4_NL, IQ4_XS, MXFP4 in steps of up to 4 rows, x per block of 32, bigger
                 ones (prefill) on the float32 path, faster there (a row's bits then differ
                 between steps below and above 5 rows); onnxruntime: int8
                 activations per block. auto picks blocks where the CPU has AVX-512 BF16 or only
                 AVX2, else onnxruntime's (AVX-512 without BF16). FORGE_KERNEL_ISA=avx512 builds
                 the kernels without the tiles.

The blocks backend reads every type products.QMATMUL_TYPES names from the file (Q2_K to Q6_K, the
legacy types, IQ4_NL, IQ4_XS, MXFP4, and F16, BF16, F32 as they are); onnxruntime the integer-code
types (forge.kernels.quant_blocks.SUPPORTED), F16 and BF16 widened to float32; any other type is
dense float32 under every backend (forge.models.llama.weight_memory refuses a file whose widened
tensors would not fit). forge.kernels.quant_blocks is the reference every kernel is tested against.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

KERNELS = ("auto", "blocks", "amx", "onnxruntime", "fast", "numpy")
NUMERICS = ("reference", "fast", "deterministic")


@dataclass(frozen=True, slots=True)
class KernelChoice:
    backend: str              # "blocks", "onnxruntime" or "numpy"
    int8_activations: bool    # the `fast` mode
    reason: str               # why, for the start-up log line
    amx: bool = False         # big steps on the AMX tiles (the `amx` mode)
    fast_products: bool = False   # the blocks backend's fast numerics (bfloat16 or int8 products)
    det_products: bool = False    # the blocks backend's deterministic numerics (qmatmul_det.c)

    @property
    def name(self) -> str:
        return "fast" if self.int8_activations else "amx" if self.amx else self.backend

    @property
    def numerics(self) -> str:
        if self.det_products:
            return "deterministic"
        return "fast" if self.int8_activations or self.fast_products else "reference"


def choose_kernels(requested: str, numerics: str = "reference") -> KernelChoice:
    """The backend for `requested` (one of KERNELS) in `numerics` (one of NUMERICS). Raises
    ValueError for an unknown name, when onnxruntime is asked for by name and is not installed,
    or when the backend has no such numerics here."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    choice = _choose_backend(requested)
    if numerics == "deterministic":
        if requested not in ("auto", "blocks") or not _compiled_ready():
            raise ValueError("--numerics deterministic runs on the blocks backend (forge's compiled kernels): use "
                             "--kernels auto or blocks, on a host that can build them")
        return KernelChoice("blocks", False, "the file's blocks read in place, int8 activations per block of 32 with "
                            "exact integer sums (deterministic numerics)", det_products=True)
    if numerics == "reference" or choice.numerics == "fast":
        return choice
    if choice.backend == "blocks" or requested == "auto":
        kind = _fast_kind() if _compiled_ready() else ""
        tiles = _amx_rows()
        if kind == "int8+bfloat16" and not tiles:
            return replace(choice, backend="blocks", amx=False, fast_products=True,
                           reason="the file's blocks read in place, int8 activations per superblock for the "
                                  "K-quants' decode steps, bfloat16 products otherwise (fast numerics)")
        if kind in ("bfloat16", "int8+bfloat16"):
            return replace(choice, backend="blocks", amx=False, fast_products=True,
                           reason="the file's blocks read in place, bfloat16 products (fast numerics"
                                  + (f"; steps of {tiles}+ rows on the AMX tiles)" if tiles else ")"))
        if kind == "int8":
            return replace(choice, backend="blocks", amx=False, fast_products=True,
                           reason="the file's blocks read in place, int8 activations per block (fast numerics)")
        if choice.backend == "blocks":
            raise ValueError("--numerics fast on the blocks backend needs a CPU with AVX-512 BF16 (avx512_bf16) or "
                             "AVX2 without AVX-512; this host has neither (--kernels onnxruntime --numerics fast: int8 "
                             "activations)")
    if choice.backend == "onnxruntime" and requested != "amx":
        return replace(choice, amx=False, int8_activations=True, reason="int8 activations (fast numerics)")
    raise ValueError(f"--kernels {requested} has no fast numerics (the numpy reference and amx compute in "
                     "float32 or bfloat16x3 only): use --kernels blocks or onnxruntime with --numerics fast")


def _choose_backend(requested: str) -> KernelChoice:
    if requested not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {requested!r}")
    have_ort = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
    if requested == "numpy":
        return KernelChoice("numpy", False, "asked for the numpy reference")
    if requested == "blocks":
        if not _compiled_ready():
            raise ValueError("--kernels blocks needs forge's compiled kernels, which cannot be built here")
        return KernelChoice("blocks", False, "asked for products from the file's blocks")
    if requested in ("onnxruntime", "fast", "amx"):
        if not have_ort:
            raise ValueError(f"--kernels {requested} needs onnxruntime and onnx, which are not installed")
        if requested == "fast":
            return KernelChoice("onnxruntime", True, "asked for int8 activations")
        if requested == "amx":
            if not _amx_ready():
                raise ValueError("--kernels amx needs a CPU with AMX tiles (amx_bf16) that Linux lets this process "
                                 "use, and the compiled kernels; this host has not")
            return KernelChoice("onnxruntime", False, "asked for AMX", amx=True)
        return KernelChoice("onnxruntime", False, "asked for onnxruntime")
    # The blocks backend before the AMX tiles on a host that has both: decode reads each weight once
    # (1.59x the amx mode's output at one stream, 0.95x at 32, 0.80x the memory; docs/benchmarks.md),
    # and a row's bits stay the same whatever the batch, which amx's two paths do not keep.
    if _compiled_ready() and (_wide_vectors() or not have_ort):
        return KernelChoice("blocks", False, "the file's blocks read in place, float32 arithmetic")
    if have_ort:
        return KernelChoice("onnxruntime", False, "quantized weights in memory, float32 arithmetic")
    return KernelChoice("numpy", False, "no compiled kernels and onnxruntime is not installed")


def _amx_ready() -> bool:
    from forge.kernels import products

    return products.amx_ready()


def _compiled_ready() -> bool:
    from forge.kernels import compiled

    return compiled.library() is not None


def _fast_kind() -> str:
    """The compiled products' fast numerics here: "bfloat16", "int8", "int8+bfloat16" or ""
    (products.qmatmul_fast_kind)."""
    from forge.kernels import products

    return products.qmatmul_fast_kind()


def _amx_rows() -> int:
    """The fewest rows of a fast step that the compiled products take on the AMX tiles (0: none)."""
    from forge.kernels import products

    return products.qmatmul_amx_rows()


def _wide_vectors() -> bool:
    """Whether the compiled products run 16-float (AVX-512) vectors here."""
    from forge.kernels import products

    return products.qmatmul_lanes() == 16
