"""LlamaModel: one batched forward per engine step over the paged KV cache, in numpy float32.

Owns the transformer arithmetic (RMSNorm, RoPE, grouped-query attention, SwiGLU, and the optional
parts of the families in forge.models.llama.arch) and the one-sequence Model protocol on top of it. Does
no scheduling and no sampling; the only I/O is reading the model file in load().
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence
from itertools import pairwise
from typing import NoReturn

import numpy as np
import numpy.typing as npt

import forge.models.llama.det_forward as det_forward
from forge.errors import EngineError, InvalidRequest, PromptTooLong
from forge.kernels import KernelChoice, compiled, products
from forge.models.forward_batch import ForwardBatch
from forge.models.gguf_file import GGUFFile, read_gguf
from forge.models.llama.attention import attend, softcap_
from forge.models.llama.attention_plan import plan_attention
from forge.models.llama.clamped_swiglu import swiglu_oai
from forge.models.llama.kv_cache import KVCache
from forge.models.llama.linear import MatmulFn, active_pool, matmul, matmul_unsplit
from forge.models.llama.llama_config import LlamaConfig, config_from_reader
from forge.models.llama.mixture import mixture
from forge.models.llama.rope import RopeTables, apply_rope, apply_rope_exact
from forge.models.llama.weights import LayerWeights, LlamaWeights, load_weights

F32 = npt.NDArray[np.float32]
C64 = npt.NDArray[np.complex64]
I64 = npt.NDArray[np.int64]

# Block size of the throwaway cache that forward_context() builds for a full recompute.
CONTEXT_BLOCK_SIZE = 16
# From this many tokens a step runs its layers row-parallel: each thread of the MatmulPool takes a
# contiguous range of the rows through norm, projections, RoPE, SwiGLU and the residual adds (all
# on both cores, with one hand-off before and one after attention), in tiles of at most ROW_TILE
# rows to bound the temporaries. Below it each projection's columns are split instead, which keeps
# the matmuls' rows as many as the step has. Measured (2 cores, 135M, scripts/ab/ab_engine.py rows):
# 5-10% faster steps at 256-1,000 tokens; tiles of 64-128 rows were slower (each tile reads the
# layer's 14 MiB of weights again).
MIN_ROW_SPLIT_TOKENS = 256
ROW_TILE = 256


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """x * weight / rms(x) over the last axis; x is [T, H]."""
    sum_sq = np.einsum("th,th->t", x, x)                         # [T] one pass, no [T, H] temporary
    inv_rms = 1.0 / np.sqrt(sum_sq * np.float32(1.0 / x.shape[-1]) + np.float32(eps))  # [T]
    out: F32 = x * inv_rms[:, None]                              # [T, H]
    out *= weight
    return out


# The compiled row-wise kernels (forge.kernels.elementwise.c) run on the calling thread: handing
# half the rows to the pool's other thread was slower at 160 and 512 rows (RMSNorm 0.07 -> 0.14 ms
# at 512; the SiLU 0.13 -> 0.18 ms at 160, and 0.46 -> 0.39 at 512, too little to pay for it).
def rms_norm_compiled(x: F32, weight: F32, eps: float) -> F32:
    """rms_norm by the compiled kernel (x may be any view with contiguous rows)."""
    if x.dtype != np.float32 or x.ndim != 2 or x.strides[1] != 4:
        return rms_norm(x, weight, eps)
    out = np.empty(x.shape, dtype=np.float32)
    compiled.rms_norm(x, weight, eps, out)
    return out


def swiglu_compiled(gate_up: F32) -> F32:
    """swiglu by the compiled kernel."""
    gate_up = np.ascontiguousarray(gate_up, dtype=np.float32)
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    compiled.swiglu(gate_up, out)
    return out


def head_norm_(x: F32, weight: F32, eps: float) -> None:
    """RMSNorm of every head in place: x is [T, heads, hd] (a view is fine), weight [hd]."""
    sum_sq = np.einsum("thd,thd->th", x, x)                      # [T, heads]
    x *= (1.0 / np.sqrt(sum_sq * np.float32(1.0 / x.shape[-1]) + np.float32(eps)))[..., None]
    x *= weight


def projection_norm_(x: F32, weight: F32, eps: float) -> None:
    """RMSNorm over all heads of each row together, in place (OLMoE's QK-norm over the whole q or k
    projection): x is [T, heads, hd] (a view is fine), weight [heads, hd]."""
    sum_sq = np.einsum("thd,thd->t", x, x)                       # [T]
    x *= (1.0 / np.sqrt(sum_sq * np.float32(1.0 / (x.shape[1] * x.shape[2])) + np.float32(eps)))[:, None, None]
    x *= weight


def gelu_tanh_gated(gate_up: F32) -> F32:
    """GELU(gate) * up, GELU by its tanh approximation, for gate_up = [gate | up] [T, 2F]; [T, F]."""
    half = gate_up.shape[1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]              # [T, F] views
    act = gate * gate                                            # [T, F]
    act *= np.float32(0.044715)
    act += 1.0
    act *= gate
    act *= np.float32(math.sqrt(2.0 / math.pi))
    np.tanh(act, out=act)
    act += 1.0
    act *= gate
    act *= np.float32(0.5)
    act *= up
    return act


def swiglu(gate_up: F32) -> F32:
    """SiLU(gate) * up for gate_up = [gate | up] of shape [T, 2F]; returns [T, F]."""
    half = gate_up.shape[1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]              # [T, F] views
    with np.errstate(over="ignore"):                             # exp(-gate) -> inf gives SiLU = -0
        act = np.exp(-gate)                                      # [T, F]
    act += 1.0
    np.divide(gate, act, out=act)
    act *= up
    return act


class LlamaModel:
    """A loaded Llama-family model. Immutable after load; forward() writes only into the KVCache."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights) -> None:
        self.config = config
        self.weights = weights
        self.rope = RopeTables(config, weights.rope_freqs, long_divisors=weights.rope_long, exact=weights.det)
        self.sliding = [config.is_sliding(i) for i in range(config.num_layers)]
        self.has_sliding = any(self.sliding)
        self.rope_sliding = (RopeTables(config, weights.rope_freqs, sliding=True, long_divisors=weights.rope_long,
                                        exact=weights.det) if self.has_sliding else self.rope)
        self.gelu = config.arch.activation == "gelu_tanh"
        self.clamped = config.arch.activation == "swiglu_oai"         # gpt-oss's experts
        # The compiled decode attention, norms and SiLU go with the compiled kernels; --kernels numpy
        # keeps the whole forward on the numpy reference.
        self.compiled_ops = weights.kernels != "numpy" and compiled.library() is not None
        # Big steps split their rows over the pool only when the pool does the matmuls (dense
        # weights): kernels run each product on threads of their own. A mixture of experts keeps
        # the step's rows together, so that each expert's weights are read once per step.
        self._rows_split = weights.is_dense and config.moe is None
        self._qk_norm = projection_norm_ if config.arch.qk_norm_whole else head_norm_
        # The deterministic numerics' own row-wise operations (forge.models.llama.det_forward), RoPE's too.
        self.det = weights.det
        if self.det:
            self._qk_norm = det_forward.projection_norm_ if config.arch.qk_norm_whole else det_forward.head_norm_

    @classmethod
    def load(cls, path: str | os.PathLike[str], kernels: KernelChoice | None = None) -> LlamaModel:
        """Read a GGUF file, its matrices held by `kernels` (None: the numpy reference, dequantized);
        raises ModelLoadError with a one-line message."""
        return cls.from_reader(read_gguf(path), path, kernels)

    @classmethod
    def from_reader(cls, reader: GGUFFile, path: str | os.PathLike[str],
                    kernels: KernelChoice | None = None) -> LlamaModel:
        """Build from a GGUF file already read (share one read with the tokenizer). Keeps no
        reference to the file's mapping once the weights are loaded."""
        config = config_from_reader(reader, path)
        return cls(config, load_weights(reader, config, kernels))

    def serve_context(self, max_model_len: int) -> None:
        """Size the RoPE tables to the context served (at most the file's context_length), not to the file's
        claim, and pick LongRoPE's factors by it: the engine calls this once its max_model_len is known."""
        self.rope.serve(max_model_len)
        self.rope_sliding.serve(max_model_len)

    # -- the seed's one-sequence Model protocol -------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def eos_token(self) -> int:
        return self.config.eos_token_id

    def forward_context(self, context: Sequence[int]) -> F32:
        """Logits [V] for the token after `context`, recomputed from scratch in a temporary cache."""
        num_tokens = len(context)
        if num_tokens == 0:
            raise InvalidRequest("the context must hold at least one token", param="prompt")
        if num_tokens > self.config.max_position:
            raise PromptTooLong(
                f"the context has {num_tokens} tokens; this model allows {self.config.max_position}",
                param="prompt")
        token_ids = np.asarray(context, dtype=np.int64)                        # [n]
        if token_ids.ndim != 1 or token_ids.min() < 0 or token_ids.max() >= self.vocab_size:
            raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})", param="prompt")
        num_blocks = -(-num_tokens // CONTEXT_BLOCK_SIZE)
        kv = self.new_kv_cache(num_blocks, CONTEXT_BLOCK_SIZE)
        batch = ForwardBatch(
            token_ids=token_ids,
            positions=np.arange(num_tokens, dtype=np.int64),
            slot_mapping=np.arange(num_tokens, dtype=np.int64),
            query_start=np.array([0, num_tokens], dtype=np.int64),
            context_lens=np.array([num_tokens], dtype=np.int64),
            block_tables=np.arange(num_blocks, dtype=np.int64)[None, :],
            sample_indices=np.array([num_tokens - 1], dtype=np.int64),
        )
        logits: F32 = self.forward(batch, kv)[0]                               # [V]
        return logits

    # -- the engine's batched interface ---------------------------------------------------------

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: str = "float32") -> KVCache:
        return KVCache(self.config, num_blocks, block_size, dtype)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> F32:
        """One step: every token of `batch` runs through every layer; its K/V land in `kv` at
        batch.slot_mapping. Returns float32 logits [len(batch.sample_indices), V], the head
        computed only on those rows. Raises EngineError for an inconsistent batch."""
        return self.forward_hidden(batch, kv, np.empty(0, dtype=np.int64))[0]

    def forward_hidden(self, batch: ForwardBatch, kv: KVCache, hidden_rows: I64) -> tuple[F32, F32]:
        """forward(), and the final normed hidden states [len(hidden_rows), H] of those rows of the
        step's tokens (what an embedding pools), which need no head."""
        check_batch(batch, self.config, kv)
        c, w = self.config, self.weights
        num_tokens, hd = batch.num_tokens, c.head_dim
        if num_tokens == 0:
            return np.empty((0, c.vocab_size), dtype=np.float32), np.empty((0, c.hidden_size), dtype=np.float32)
        if hidden_rows.size and (hidden_rows.min() < 0 or hidden_rows.max() >= num_tokens):
            raise EngineError("inconsistent ForwardBatch: a hidden row lies outside the step's tokens")
        kept_rows = np.concatenate([batch.sample_indices, hidden_rows])          # [N + M]
        num_sampled = batch.sample_indices.size
        on_pool = self.compiled_ops and self.weights.kernels == "blocks"   # one set of threads for all
        plan = plan_attention(batch, c, kv.block_size, fused=self.compiled_ops, softcap=c.attn_softcap,
                              decode_on_pool=on_pool, det=w.det)
        # The window's own plan only once some query reaches past it: before that it is `plan`.
        reaches_past = self.has_sliding and int(batch.positions.max()) >= c.sliding_window
        plan_sliding = (plan_attention(batch, c, kv.block_size, fused=self.compiled_ops, window=c.sliding_window,
                                       softcap=c.attn_softcap, decode_on_pool=on_pool, det=w.det)
                        if reaches_past else plan)
        scale = np.float32(c.attention_scale)
        last = c.num_layers - 1
        rotation = self.rope.at(batch.positions)                                # [T, 1, rope_dim / 2] complex
        rotation_sliding = self.rope_sliding.at(batch.positions) if self.has_sliding else rotation
        x = w.embed(batch.token_ids)                                            # [T, H]
        if c.arch.scale_embeddings:
            x *= np.float32(math.sqrt(c.hidden_size))
        pool = active_pool()
        row_parts = (_row_parts(num_tokens, pool.num_parts)
                     if num_tokens >= MIN_ROW_SPLIT_TOKENS and self._rows_split else [])
        for i, layer in enumerate(w.layers):
            q = np.empty((num_tokens, c.num_heads, hd), dtype=np.float32)      # [T, nh, hd]
            layer_rotation = rotation_sliding if self.sliding[i] else rotation
            inputs = functools.partial(self._attention_inputs, layer, i, x, layer_rotation, batch.slot_mapping, kv,
                                       scale, q)
            if row_parts:
                pool.run_parts(functools.partial(inputs, matmul_unsplit), row_parts)
            else:
                inputs(matmul, [(0, num_tokens)])
            attn = attend(plan_sliding if self.sliding[i] else plan, q, kv.k[i], kv.v[i], kv.scratch,
                          kv.layer_scales(i), fast=w.fast, sinks=layer.sinks)
            attn = attn.reshape(num_tokens, -1)                                 # [T, nh * hd]
            if i == last:  # past the last attention only the sampled (and pooled) rows matter
                x, attn = x[kept_rows], attn[kept_rows]                        # [N + M, H], [N + M, nh * hd]
                row_parts = []
            if row_parts:
                pool.run_parts(functools.partial(self._block_outputs, layer, x, attn, matmul_unsplit), row_parts)
            else:
                self._block_outputs(layer, x, attn, matmul, [(0, len(x))])
        x = self._norm(x, w.out_norm, c.rms_eps)                                # [N + M, H]
        return self.head_logits(x[:num_sampled]), x[num_sampled:]               # [N, V], [M, H]

    def head_logits(self, hidden: F32) -> F32:
        """The logits [N, V] of final normed hidden states [N, H] (forward_hidden's): the head, softcapped
        where the model says. forward's logits are these of its sampled rows; a row's do not depend on the
        others under the reference numerics."""
        logits = matmul(hidden, self.weights.head)                              # [N, V]
        if self.compiled_ops and self.weights.kernels == "blocks":
            products.pool_park()      # a step's last product: the pool sleeps while Python (sampling, the server) runs
        if self.config.final_softcap:                                           # gemma2
            (det_forward.softcap_ if self.det else softcap_)(logits, self.config.final_softcap)
        return logits

    def _attention_inputs(self, layer: LayerWeights, index: int, x: F32, rotation: C64, slots: I64, kv: KVCache,
                          scale: np.float32, q: F32, mm: MatmulFn, rows: list[tuple[int, int]]) -> None:
        """Rows [lo, hi) of each tile in `rows`: normed, projected to q/k/v (by `mm`: matmul, or
        matmul_unsplit inside a pool part), rotated; their K/V written to layer `index` of the cache,
        their scaled queries into q [T, nh, hd]."""
        c = self.config
        nh, nkv = c.num_heads, c.num_kv_heads
        for lo, hi in rows:
            heads = mm(self._norm(x[lo:hi], layer.attn_norm, c.rms_eps), layer.wqkv)
            if layer.qkv_bias is not None:
                heads += layer.qkv_bias
            heads = heads.reshape(hi - lo, -1, c.head_dim)                      # [n, nh + 2 nkv, hd]
            if layer.q_norm is not None and layer.k_norm is not None:
                self._qk_norm(heads[:, :nh], layer.q_norm, c.rms_eps)
                self._qk_norm(heads[:, nh : nh + nkv], layer.k_norm, c.rms_eps)
            (apply_rope_exact if self.det else apply_rope)(heads[:, : nh + nkv], rotation[lo:hi])
            kv.write(index, slots[lo:hi], heads[:, nh : nh + nkv], heads[:, nh + nkv :])
            np.multiply(heads[:, :nh], scale, out=q[lo:hi])

    def _block_outputs(self, layer: LayerWeights, x: F32, attn: F32, mm: MatmulFn,
                       rows: list[tuple[int, int]]) -> None:
        """Rows [lo, hi) of each tile in `rows`: x += the attention's projection, then the MLP
        (matmuls by `mm`, as in _attention_inputs)."""
        eps = self.config.rms_eps
        for lo, hi in rows:
            xt = x[lo:hi]                                                       # [n, H] view
            out = mm(attn[lo:hi], layer.wo)
            if layer.wo_bias is not None:
                out += layer.wo_bias
            xt += out if layer.post_attn_norm is None else self._norm(out, layer.post_attn_norm, eps)
            out = self._mlp(layer, self._norm(xt, layer.ffn_norm, eps), mm)
            xt += out if layer.post_ffn_norm is None else self._norm(out, layer.post_ffn_norm, eps)

    # Looked up at each call, not bound at load, so that scripts/ab/profile_step.py can time them.
    def _norm(self, x: F32, weight: F32, eps: float) -> F32:
        if self.det:
            return det_forward.rms_norm(x, weight, eps)
        return (rms_norm_compiled if self.compiled_ops else rms_norm)(x, weight, eps)

    def _mlp(self, layer: LayerWeights, x: F32, mm: MatmulFn) -> F32:
        """The layer's MLP of its normed input x [n, H]: gated, or a mixture of experts."""
        if layer.moe is not None and self.config.moe is not None:
            return mixture(x, layer.moe, self.config.moe, mm, self._activation, det=self.det)
        assert layer.w_gate_up is not None and layer.w_down is not None
        return mm(self._activation(mm(x, layer.w_gate_up)), layer.w_down)

    def _activation(self, gate_up: F32) -> F32:
        if self.det:
            return det_forward.gated(gate_up, self.config.arch.activation)
        if self.gelu:
            return gelu_tanh_gated(gate_up)
        if self.clamped:
            return swiglu_oai(gate_up)
        return (swiglu_compiled if self.compiled_ops else swiglu)(gate_up)


def _row_parts(num_tokens: int, num_parts: int) -> list[list[tuple[int, int]]]:
    """The rows cut into num_parts contiguous runs of about equal length, each run into tiles
    [lo, hi) of at most ROW_TILE rows, also about equal."""
    parts = []
    for p in range(num_parts):
        start, stop = num_tokens * p // num_parts, num_tokens * (p + 1) // num_parts
        if stop > start:
            num_tiles = -(-(stop - start) // ROW_TILE)
            cuts = [start + (stop - start) * t // num_tiles for t in range(num_tiles + 1)]
            parts.append(list(pairwise(cuts)))
    return parts


def check_batch(batch: ForwardBatch, config: LlamaConfig, kv: KVCache) -> None:
    """Cheap O(T + S * B) consistency checks; a failure is forge's own fault (EngineError)."""
    num_tokens, num_seqs = batch.num_tokens, batch.num_seqs
    starts = batch.query_start

    def fail(what: str) -> NoReturn:
        raise EngineError(f"inconsistent ForwardBatch: {what}")

    if kv.k.shape[0] != config.num_layers or kv.k.shape[3:] != (config.num_kv_heads, config.head_dim):
        fail(f"the KV cache has shape {kv.k.shape}, built for another model")
    if batch.positions.shape != (num_tokens,) or batch.slot_mapping.shape != (num_tokens,):
        fail("token_ids, positions and slot_mapping differ in length")
    if starts.shape != (num_seqs + 1,) or batch.block_tables.ndim != 2 or batch.block_tables.shape[0] != num_seqs:
        fail("query_start, context_lens and block_tables disagree on the number of sequences")
    if starts[0] != 0 or starts[-1] != num_tokens or np.any(np.diff(starts) < 0):
        fail("query_start is not a cumulative count of the tokens")
    if num_tokens and (batch.token_ids.min() < 0 or batch.token_ids.max() >= config.vocab_size):
        fail(f"a token id lies outside [0, {config.vocab_size})")
    if num_tokens and (batch.positions.min() < 0 or batch.positions.max() >= config.max_position):
        fail(f"a position lies outside [0, {config.max_position})")
    if num_tokens and (batch.slot_mapping.min() < 0 or batch.slot_mapping.max() >= kv.num_slots):
        fail(f"a slot lies outside [0, {kv.num_slots})")
    if batch.block_tables.size and (batch.block_tables.min() < 0 or batch.block_tables.max() >= kv.num_blocks):
        fail(f"a block id lies outside [0, {kv.num_blocks})")
    if num_seqs and int(batch.context_lens.max()) > batch.block_tables.shape[1] * kv.block_size:
        fail("a context is longer than its block table")
    seq_of_token = np.repeat(np.arange(num_seqs), np.diff(starts))                       # [T]
    if np.any(batch.positions >= batch.context_lens[seq_of_token]):
        fail("a query position is not below its sequence's context length")
    if batch.sample_indices.size and (batch.sample_indices.min() < 0 or batch.sample_indices.max() >= num_tokens):
        fail("a sample index lies outside the step's tokens")
