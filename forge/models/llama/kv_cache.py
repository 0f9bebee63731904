"""The K/V storage of the paged cache, and the scratch buffers attention reuses.

Owns the K/V arrays ([num_layers, num_blocks, block_size, num_kv_heads, head_dim], preallocated
once, in float32, float16, bfloat16 or int8 with float16 scales beside them: forge.models.llama.kv_dtype)
and writing a step's new K/V into their slots. Which blocks a sequence owns is the allocator's
business.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from forge.kernels import compiled
from forge.models.llama.kv_dtype import (
    INT8_GROUP,
    check_head_dim,
    dequantize_int8,
    quantize_int8,
    row_bytes,
    storage_dtype,
    to_float32,
    to_storage,
)
from forge.models.llama.llama_config import LlamaConfig

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
KV = npt.NDArray[np.generic]   # a K or V array in its storage dtype (forge.models.llama.kv_dtype)
Scales = npt.NDArray[np.float16]  # an int8 cache's scales, [..., head_dim / INT8_GROUP]


class Scratch:
    """Reusable float32 buffers for attention's temporaries (gathered keys/values, scores), grown
    on demand and kept across layers and steps, so a step allocates no large arrays."""

    def __init__(self) -> None:
        self._buffers: list[F32] = [np.empty(0, np.float32) for _ in range(4)]
        self._parts: list[Scratch] = [self]

    def part(self, index: int) -> Scratch:
        """The scratch of part `index` (0: this one): parts run on different threads, so each
        has its own buffers. Call from the thread that hands out the parts."""
        while len(self._parts) <= index:
            self._parts.append(Scratch())
        return self._parts[index]

    def get(self, slot: int, shape: tuple[int, ...]) -> F32:
        """A C-contiguous [shape] view of buffer `slot` (0: keys, 1: values, 2: scores, 3: the fused
        kernel's scores); its
        contents are garbage until written, and the next get() of the same slot reuses them."""
        size = int(np.prod(shape))
        if self._buffers[slot].size < size:
            self._buffers[slot] = np.empty(size, np.float32)
        return self._buffers[slot][:size].reshape(shape)

    def gather(self, slot: int, cache: KV, block_ids: I64, scales: Scales | None = None) -> F32:
        """cache[block_ids] as float32 [*block_ids.shape, *cache.shape[1:]]: for a float32 cache, a
        view of it when the ids are one run of consecutive blocks (one sequence whose blocks were
        allocated in order, as a lone sequence's usually are), else copied (and widened from a
        half-precision cache, or from int8 by its `scales`) into buffer `slot`. mode="clip" lets
        take write straight into `out` (mode="raise" buffers a second copy); the block ids were
        checked against the cache before the step. Read-only: the result may be the cache."""
        shape = (*block_ids.shape, *cache.shape[1:])
        flat = block_ids.reshape(-1)
        if flat.size and (block_ids.ndim == 1 or block_ids.shape[0] == 1):
            first, n = int(flat[0]), flat.size
            if int(flat[-1]) == first + n - 1 and (n < 3 or bool(np.all(np.diff(flat) == 1))):
                run = cache[first:first + n].reshape(shape)
                if scales is not None:
                    return dequantize_int8(run, scales[first:first + n].reshape(*shape[:-1], -1),
                                           self.get(slot, shape))
                return run if run.dtype == np.float32 else to_float32(run, self.get(slot, shape))
        out = self.get(slot, shape)
        if scales is not None:
            return dequantize_int8(np.take(cache, block_ids, axis=0, mode="clip"),
                                   np.take(scales, block_ids, axis=0, mode="clip"), out)
        if cache.dtype == np.float32:
            return np.take(cache, block_ids, axis=0, out=out, mode="clip")
        return to_float32(np.take(cache, block_ids, axis=0, mode="clip"), out)


class KVCache:
    """The K and V arrays of every layer; a flat slot is block_id * block_size + offset. Stored in
    `dtype` (forge.models.llama.kv_dtype: float32, float16, bfloat16 as uint16 bits, or int8 with its
    float16 scales in k_scales / v_scales, None for the other types); attention widens what it
    reads to float32 and computes in float32."""

    def __init__(self, config: LlamaConfig, num_blocks: int, block_size: int, dtype: str = "float32") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        check_head_dim(dtype, config.head_dim)
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.dtype = dtype
        storage = storage_dtype(dtype)
        # zeros, not empty: padded reads multiply stale slots by probability 0, which needs finite values
        self.k: KV = np.zeros(shape, dtype=storage)
        self.v: KV = np.zeros(shape, dtype=storage)
        self.k_scales: Scales | None = None
        self.v_scales: Scales | None = None
        if dtype == "int8":
            scale_shape = (*shape[:-1], config.head_dim // INT8_GROUP)
            self.k_scales = np.zeros(scale_shape, dtype=np.float16)
            self.v_scales = np.zeros(scale_shape, dtype=np.float16)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch = Scratch()

    def layer_scales(self, layer: int) -> tuple[Scales, Scales] | None:
        """Layer `layer`'s K and V scales (an int8 cache), else None."""
        if self.k_scales is None or self.v_scales is None:
            return None
        return self.k_scales[layer], self.v_scales[layer]

    def write(self, layer: int, slot_mapping: I64, k: F32, v: F32) -> None:
        """Store one layer's new keys and values [T, nkv, hd] (float32) at their flat slots, in the
        cache's dtype (rounded to nearest; int8 quantized per group of INT8_GROUP values): by the
        compiled writer, one call each, where there is one (the slots were checked with the
        batch), else numpy's (the reference it matches bit for bit)."""
        pairs = ((self.k, self.k_scales, k), (self.v, self.v_scales, v))
        if compiled.library() is not None and all(x.dtype == np.float32 and x.strides[2] == 4
                                                  and x.strides[1] == 4 * x.shape[2] for x in (k, v)):
            for values, scales, x in pairs:
                compiled.kv_store(x, slot_mapping, values[layer], None if scales is None else scales[layer],
                                  trusted=True)
            return
        num_layers, _, _, nkv, hd = self.k.shape
        flat = (num_layers, self.num_blocks * self.block_size, nkv, hd)
        for values, scales, x in pairs:
            if scales is None:
                values.reshape(flat)[layer, slot_mapping] = to_storage(x, values.dtype)
                continue
            q, s = quantize_int8(x)
            values.reshape(flat)[layer, slot_mapping] = q
            scales.reshape(*flat[:-1], -1)[layer, slot_mapping] = s

    def commit_memory(self, run_parts: Callable[[Callable[[range], None], list[range]], None] | None = None,
                      num_parts: int = 1) -> None:
        """Write every page of the K and V arrays once. Until a page is first written it is not the
        process's: the step that first writes a block's K/V takes a page fault for each of its pages
        (a 512-token prefill step writes ~200 per layer), which on some virtual machines costs tens
        of microseconds each (scripts/ab/ab_engine.py kv-commit). Committing at start moves that to
        start-up, and the memory the cache will use is taken (or refused) then, not under load.
        With `run_parts` (forge.models.llama.linear's MatmulPool.run_parts) the layers are dealt into
        `num_parts` parts that run at once; the values stay zero."""
        arrays = [a for a in (self.k, self.v, self.k_scales, self.v_scales) if a is not None]

        def touch(layers: range) -> None:
            for layer in layers:
                for a in arrays:
                    a[layer].reshape(-1)[::max(1, 4096 // a.itemsize)] = 0
        parts = [range(i, self.k.shape[0], num_parts) for i in range(num_parts)]
        if run_parts is None:
            for part in parts:
                touch(part)
        else:
            run_parts(touch, parts)

    def first_layers(self, num_layers: int) -> KVCache:
        """The K/V of layers [0, num_layers) as a cache of its own: views of these arrays, so writes
        through either land in both (a draft made of the model's first layers shares its cache)."""
        view = object.__new__(KVCache)
        view.dtype, view.num_blocks, view.block_size = self.dtype, self.num_blocks, self.block_size
        view.k, view.v = self.k[:num_layers], self.v[:num_layers]
        view.k_scales = None if self.k_scales is None else self.k_scales[:num_layers]
        view.v_scales = None if self.v_scales is None else self.v_scales[:num_layers]
        view.scratch = Scratch()
        return view

    @staticmethod
    def bytes_per_block(config: LlamaConfig, block_size: int, dtype: str = "float32") -> int:
        """Bytes one block costs across all layers, K and V together, stored in `dtype` (with an
        int8 cache's scales)."""
        return 2 * config.num_layers * block_size * config.num_kv_heads * row_bytes(dtype, config.head_dim)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size
