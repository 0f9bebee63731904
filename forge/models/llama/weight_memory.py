"""What a model's weights will take in memory, known from the file's header alone, and the refusal of
a file whose tensors forge would widen to float32 past the memory this machine has.

Each backend keeps some tensor types as the file's own blocks (at the file's size: forge.kernels) and
widens the others to float32 at load, four bytes a value: a 2-bit file widened is sixteen times its
size. Loading such a file would fail for memory partway through, or leave the daemon to be killed
later; instead it is refused at start, before anything is allocated, in one line naming the widened
types and what they would take. Only matrices count as widened: norms and biases are float32 copies
under every backend (counted, at four bytes a value). A mixture's experts stay views of the file
under every backend (forge.models.llama.experts).
"""

from __future__ import annotations

from collections import defaultdict

from gguf.constants import GGMLQuantizationType

from forge.errors import ModelLoadError
from forge.kernels import KernelChoice, products
from forge.kernels.quant_blocks import SUPPORTED
from forge.models.gguf_file import GGUFFile

GIB = 1 << 30
_F32 = GGMLQuantizationType.F32
_EXPERTS = "_exps."          # the 3-D expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps)


def kept_types(kernels: KernelChoice | None) -> frozenset[int]:
    """The ggml types `kernels` holds as the file's blocks: under blocks every type the compiled
    products read, under onnxruntime the integer-code types, under the numpy reference none."""
    if kernels is None or kernels.backend == "numpy":
        return frozenset()
    if kernels.backend == "blocks":
        return products.QMATMUL_TYPES
    return frozenset(int(t) for t in SUPPORTED)


def weight_bytes(reader: GGUFFile, kernels: KernelChoice | None) -> tuple[int, dict[str, int]]:
    """The bytes the weights would take (kept types at the file's size, F32 at its own, the rest at
    four bytes a value), and of them the widened matrices' bytes by type name."""
    kept = kept_types(kernels)
    held, widened = 0, defaultdict[str, int](int)
    for name, tensor in reader.tensors.items():
        values = 1
        for n in tensor.shape:
            values *= int(n)
        file_bytes = int(tensor.data.nbytes)
        if tensor.tensor_type == _F32 or int(tensor.tensor_type) in kept or _EXPERTS in name:
            held += file_bytes
        else:
            held += 4 * values
            if len(tensor.shape) >= 2:
                widened[tensor.tensor_type.name] += 4 * values
    return held, dict(widened)


def available_memory() -> int | None:
    """Bytes this process can still take: /proc/meminfo's MemAvailable, or less where a cgroup's limit
    (v2 memory.max less memory.current) leaves less; None where neither reads."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = f.read().strip()
        if limit.isdigit() and current.isdigit():
            found.append(max(0, int(limit) - int(current)))
    except OSError:
        pass
    return min(found) if found else None


def check_weight_memory(reader: GGUFFile, model_name: str, kernels: KernelChoice | None,
                        available: int | None = None) -> None:
    """Raise ModelLoadError when the weights, with some matrices widened to float32, would take more
    than `available` bytes (None: available_memory()). A file kept whole in its blocks is never
    refused here: its pages are the page cache's to evict."""
    held, widened = weight_bytes(reader, kernels)
    if not widened:
        return
    available = available_memory() if available is None else available
    if available is None or held <= available:
        return
    backend = "numpy" if kernels is None else kernels.name
    types = ", ".join(f"{name} ({_size(n)})" for name, n in sorted(widened.items(), key=lambda item: -item[1]))
    hint = ""
    if backend != "blocks" and all(int(GGMLQuantizationType[name]) in products.QMATMUL_TYPES for name in widened):
        hint = "; --kernels blocks keeps them at the file's size"
    raise ModelLoadError(f"{model_name}: the weights would take {_size(held)}, more than the {_size(available)} "
                         f"of memory available: --kernels {backend} widens {types} to float32{hint}")


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"
