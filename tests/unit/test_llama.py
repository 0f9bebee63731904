"""Tests for forge.models.llama: the paged, batched forward against a dense reference, loading errors,
and a smoke test on the real default model (tests/conftest.py's `default_model_path`)."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize

from forge.errors import EngineError, InvalidRequest, ModelLoadError
from forge.kernels import choose_kernels
from forge.models.forward_batch import ForwardBatch
from forge.models.gguf_file import read_gguf
from forge.models.llama import KVCache, LlamaConfig, LlamaModel, attention_plan, kv_cache
from forge.models.llama import linear as linear_mod
from forge.models.llama import llama_model as model_mod
from tests.tiny_gguf import write_tiny_llama

BLOCK_SIZE = 4
PROMPT = [5, 17, 3, 42, 8, 8, 29, 60, 1, 33, 12]


# -- a dense reference, independent of forge.models.llama --------------------------------------------
# Plain full causal attention in float64, np.repeat for GQA, and RoPE in the half-split form
# after undoing the GGUF row permutation (forge rotates adjacent pairs on the stored rows).

def _meta(reader: gguf.GGUFReader, key: str) -> float:
    return reader.fields[key].contents()


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Logits [n, V] at every position of `tokens`, from scratch."""
    hidden, head = reference_hidden(path, tokens)
    return hidden @ head.T


def reference_hidden(path: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The final normed hidden states [n, H] at every position of `tokens`, and the head [V, H]."""
    reader = gguf.GGUFReader(path)
    w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in reader.tensors}
    num_layers = _meta(reader, "llama.block_count")
    nh = _meta(reader, "llama.attention.head_count")
    nkv = _meta(reader, "llama.attention.head_count_kv")
    base = _meta(reader, "llama.rope.freq_base")
    eps = _meta(reader, "llama.attention.layer_norm_rms_epsilon")
    hidden = _meta(reader, "llama.embedding_length")
    hd = hidden // nh
    n = len(tokens)

    def norm(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(n)[:, None] * inv[None, :]                          # [n, hd/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None]   # [n, 1, hd]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None]

    def rope(x: np.ndarray) -> np.ndarray:
        rotated = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], axis=-1)
        return x * cos + rotated * sin

    causal = np.triu(np.full((n, n), -np.inf), k=1)
    x = w["token_embd.weight"][tokens]
    for i in range(num_layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope((h @ _unpermute(w[p + "attn_q.weight"], nh).T).reshape(n, nh, hd))
        k = rope((h @ _unpermute(w[p + "attn_k.weight"], nkv).T).reshape(n, nkv, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(n, nkv, hd)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", att, v).reshape(n, nh * hd) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return norm(x, w["output_norm.weight"]), head


# -- a small pager: shuffled, non-contiguous blocks per sequence --------------------------------

class Pager:
    def __init__(self, model: LlamaModel, *, num_blocks: int = 64, seed: int = 0, kv_dtype: str = "float32") -> None:
        self.model = model
        self.kv = model.new_kv_cache(num_blocks, BLOCK_SIZE, kv_dtype)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> dict[str, np.ndarray]:
        """Run one step over (sequence, new tokens) pairs; logits for every new token."""
        tokens, positions, slots, starts, ctx = [], [], [], [0], []
        for seq, new in chunks:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            end = start + len(new)
            while len(table) * BLOCK_SIZE < end:
                table.append(self.free.pop())
            pos = list(range(start, end))
            tokens += new
            positions += pos
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            starts.append(starts[-1] + len(new))
            ctx.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for s, (seq, _) in enumerate(chunks):
            tables[s, : len(self.tables[seq])] = self.tables[seq]
        batch = ForwardBatch(
            token_ids=np.array(tokens, dtype=np.int64), positions=np.array(positions, dtype=np.int64),
            slot_mapping=np.array(slots, dtype=np.int64), query_start=np.array(starts, dtype=np.int64),
            context_lens=np.array(ctx, dtype=np.int64), block_tables=tables,
            sample_indices=np.arange(len(tokens), dtype=np.int64),
        )
        logits = self.model.forward(batch, self.kv)
        assert logits.dtype == np.float32 and logits.shape == (len(tokens), self.model.vocab_size)
        return {seq: logits[starts[s]:starts[s + 1]] for s, (seq, _) in enumerate(chunks)}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> LlamaModel:
    return LlamaModel.load(tiny_path)


@pytest.fixture(scope="module")
def reference(tiny_path: Path) -> np.ndarray:
    return reference_logits(tiny_path, PROMPT)


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


# -- numerics ---------------------------------------------------------------------------------

def test_tiny_config_comes_from_metadata(tiny: LlamaModel) -> None:
    c = tiny.config
    assert isinstance(c, LlamaConfig)
    assert (c.vocab_size, c.num_layers, c.hidden_size, c.intermediate_size) == (64, 2, 32, 48)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rope_dim) == (4, 2, 8, 8)
    assert (c.rope_theta, c.max_position, c.bos_token_id, c.eos_token_id) == (10000.0, 256, 1, 2)
    assert c.tied_embeddings and c.name == "tiny.gguf"
    assert (tiny.vocab_size, tiny.num_layers, tiny.eos_token) == (64, 2, 2)
    layer = tiny.weights.layers[0]
    assert layer.wqkv.shape == (32, (4 + 2 * 2) * 8) and layer.wqkv.flags.c_contiguous
    assert layer.w_gate_up.shape == (32, 96) and layer.w_down.shape == (48, 32)
    assert layer.w_down.T.flags.c_contiguous                            # down stored [out, in]
    assert tiny.weights.head.shape == (32, 64) and tiny.weights.head.flags.c_contiguous
    assert np.shares_memory(tiny.weights.head, tiny.weights.embedding)  # tied: no second copy


def test_whole_prompt_in_one_step(tiny: LlamaModel, reference: np.ndarray) -> None:
    close(Pager(tiny).step([("a", PROMPT)])["a"], reference)


def test_chunked_prefill(tiny: LlamaModel, reference: np.ndarray) -> None:
    pager = Pager(tiny, seed=1)
    got = [pager.step([("a", PROMPT[i:i + 3])])["a"] for i in range(0, len(PROMPT), 3)]
    close(np.concatenate(got), reference)


def test_prefill_then_decode(tiny: LlamaModel, reference: np.ndarray) -> None:
    pager = Pager(tiny, seed=2)
    got = [pager.step([("a", PROMPT[:4])])["a"]]
    got += [pager.step([("a", [tok])])["a"] for tok in PROMPT[4:]]
    close(np.concatenate(got), reference)


# Half-precision K/V: every stored key and value is rounded once (float16: 11 significant bits,
# bfloat16: 8); attention still computes in float32. Measured on this model (logits up to 29 in
# size), the largest logit error against the float64 reference is 4.9e-3 (float16) and 5.0e-2
# (bfloat16), against 7e-6 for a float32 cache; the bounds leave twice that.
KV_TOLERANCE = {"float16": 1e-2, "bfloat16": 1e-1}


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernels", ["numpy", "onnxruntime", "blocks"])
def test_half_precision_kv_prefill_then_decode(tiny_path: Path, reference: np.ndarray, kv_dtype: str,
                                               kernels: str) -> None:
    """The paged cache in half precision, through the numpy reference attention and through the
    compiled kernels (the decode rows read float16/bfloat16 directly), against float64."""
    model = LlamaModel.load(tiny_path, choose_kernels(kernels))
    assert model.compiled_ops == (kernels != "numpy")
    pager = Pager(model, seed=5, kv_dtype=kv_dtype)
    assert pager.kv.k.itemsize == 2
    got = [pager.step([("a", PROMPT[:4])])["a"]]
    got += [pager.step([("a", [tok]), ("b", [tok, 3])])["a"] for tok in PROMPT[4:]]
    np.testing.assert_allclose(np.concatenate(got), reference, atol=KV_TOLERANCE[kv_dtype], rtol=0)


# int8 K/V: each group of 32 stored values is rounded to a step of max |x| / 127 (llama.cpp's q8_0).
# Measured on a model with heads of 32 (logits up to 110 in size): the largest logit error
# against float64 is 0.21 (float16 0.0085, bfloat16 0.055, float32 3.6e-5), the same through numpy
# and the compiled kernels; the bound leaves twice that.
INT8_KV_TOLERANCE = 0.5


@pytest.mark.parametrize("kernels", ["numpy", "blocks"])
def test_int8_kv_prefill_then_decode(tmp_path: Path, kernels: str) -> None:
    """The paged cache in int8, written by the compiled writer or numpy's and read by the kernels
    (prefill and decode) or the numpy reference attention, against float64."""
    path = write_tiny_llama(tmp_path / "wide.gguf", hidden=128, heads=4, kv_heads=2, ffn=96)
    reference = reference_logits(path, PROMPT)
    model = LlamaModel.load(path, choose_kernels(kernels))
    pager = Pager(model, seed=5, kv_dtype="int8")
    assert pager.kv.k.dtype == np.int8 and pager.kv.k_scales is not None
    got = [pager.step([("a", PROMPT[:4])])["a"]]
    got += [pager.step([("a", [tok]), ("b", [tok, 3])])["a"] for tok in PROMPT[4:]]
    np.testing.assert_allclose(np.concatenate(got), reference, atol=INT8_KV_TOLERANCE, rtol=0)
    assert np.abs(pager.kv.k_scales).max() > 0                      # written through the scales


def test_forward_context_is_last_position(tiny: LlamaModel, reference: np.ndarray) -> None:
    logits = tiny.forward_context(PROMPT)
    assert logits.shape == (64,)
    close(logits, reference[-1])


def test_batch_independence(tiny: LlamaModel, tiny_path: Path) -> None:
    histories = {"a": PROMPT[:6], "b": PROMPT[:9], "c": [7, 7, 7], "d": PROMPT[2:]}
    new = {"a": [11], "b": [4, 9, 50, 2], "c": [13], "d": [6, 1, 40]}  # decodes and prefill chunks
    batched = Pager(tiny, seed=3)
    batched.step(list(histories.items()))
    together = batched.step(list(new.items()))
    for seq in histories:
        alone = Pager(tiny, seed=4)
        alone.step([(seq, histories[seq])])
        np.testing.assert_allclose(together[seq], alone.step([(seq, new[seq])])[seq], atol=1e-5, rtol=0)
        close(together[seq], reference_logits(tiny_path, histories[seq] + new[seq])[-len(new[seq]):])


def test_small_temporaries_split_the_work(tiny: LlamaModel, reference: np.ndarray,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny budgets force one decode group per sequence and one-row prefill tiles."""
    monkeypatch.setattr(attention_plan, "MAX_TEMP_FLOATS", 1)
    monkeypatch.setattr(attention_plan, "MAX_PREFILL_TILE_ROWS", 2)
    pager = Pager(tiny, seed=5)
    first = pager.step([("a", PROMPT[:7]), ("b", PROMPT[:3]), ("c", PROMPT[:5])])
    close(first["a"], reference[:7])
    second = pager.step([("a", [PROMPT[7]]), ("b", [PROMPT[3]]), ("c", [PROMPT[5]])])
    for seq, n in (("a", 7), ("b", 3), ("c", 5)):
        close(second[seq], reference[n:n + 1])


@pytest.mark.parametrize("num_threads", [2, 3])
@pytest.mark.parametrize("max_temp", [attention_plan.MAX_TEMP_FLOATS, 1])
def test_parallel_decode_equals_serial(tiny: LlamaModel, tiny_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       num_threads: int, max_temp: int) -> None:
    """Decode parts on a split pool give the serial forward's logits; max_temp 1: a group per sequence."""
    monkeypatch.setattr(attention_plan, "MAX_TEMP_FLOATS", max_temp)
    plans: list[attention_plan.AttentionPlan] = []

    def spy(*args: object, **kwargs: object) -> attention_plan.AttentionPlan:
        plans.append(attention_plan.plan_attention(*args, **kwargs))  # type: ignore[arg-type]
        return plans[-1]

    monkeypatch.setattr(model_mod, "plan_attention", spy)
    histories = {"a": PROMPT[:6], "b": PROMPT[:9], "c": [7, 7, 7], "d": PROMPT[2:], "e": PROMPT[:2]}
    new = {"a": [11], "b": [4], "c": [13], "d": [6, 1, 40], "e": [9]}  # four decodes and a prefill chunk
    got = {}
    pool = linear_mod.MatmulPool("split", num_threads)
    monkeypatch.setattr(linear_mod, "_active", pool)
    try:
        for parallel in (True, False):
            monkeypatch.setattr(attention_plan, "MIN_PARALLEL_DECODE_SEQS", 2 if parallel else 1 << 30)
            pager = Pager(tiny, seed=7)
            pager.step(list(histories.items()))
            got[parallel] = pager.step(list(new.items()))
            parts = plans[-1].decode_parts
            assert len(parts) == (min(num_threads, 4) if parallel else 1)
            rows = np.concatenate([g.rows for part in parts for g in part])
            assert sorted(rows.tolist()) == [0, 1, 2, 6]              # every decode row once
    finally:
        pool.close()
    for seq in histories:
        # groups pad to different key counts, so sums may round differently in the last bit
        np.testing.assert_allclose(got[True][seq], got[False][seq], atol=1e-5, rtol=1e-6)
        close(got[True][seq], reference_logits(tiny_path, histories[seq] + new[seq])[-len(new[seq]):])



@pytest.mark.parametrize("num_threads", [2, 3])
def test_parallel_prefill_equals_serial(tiny: LlamaModel, tiny_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        num_threads: int) -> None:
    """Prefill tiles dealt over a split pool (one long chunk split tile by tile, short chunks whole,
    alongside decodes) give the serial forward's logits."""
    monkeypatch.setattr(attention_plan, "MAX_PREFILL_TILE_ROWS", 2)
    monkeypatch.setattr(attention_plan, "MIN_PARALLEL_PREFILL_COST", 0)
    plans: list[attention_plan.AttentionPlan] = []

    def spy(*args: object, **kwargs: object) -> attention_plan.AttentionPlan:
        plans.append(attention_plan.plan_attention(*args, **kwargs))  # type: ignore[arg-type]
        return plans[-1]

    monkeypatch.setattr(model_mod, "plan_attention", spy)
    long = (PROMPT * 3)[:30]
    histories = {"a": PROMPT[:6], "b": PROMPT[:9], "c": [7, 7, 7], "d": PROMPT[2:], "e": PROMPT[:2]}
    new = {"a": [11], "b": [4], "c": [13, 2], "d": [6, 1, 40], "e": long}  # two decodes, three prefill chunks
    num_rows = sum(len(tokens) for tokens in new.values())
    decode_rows = [0, 1]  # a and b come first
    got = {}
    pool = linear_mod.MatmulPool("split", num_threads)
    monkeypatch.setattr(linear_mod, "_active", pool)
    try:
        for parallel in (True, False):
            pager = Pager(tiny, seed=7)
            pager.step(list(histories.items()))
            got[parallel] = pager.step(list(new.items()))
            if not parallel:
                break
            parts = plans[-1].prefill_parts
            assert len(parts) == num_threads and all(parts)
            rows = [r for part in parts for p in part for t in p.tiles for r in range(t.lo, t.hi)]
            assert sorted(rows + decode_rows) == list(range(num_rows))  # every row once
            lens = [[p.context_len for p in part] for part in parts]
            assert all(len(set(n)) == len(n) for n in lens)  # each sequence at most once per part
            assert sum(n.count(len(histories["e"]) + len(long)) for n in lens) > 1  # the long one split
            assert sum(n.count(len(histories["d"]) + 3) for n in lens) == 1  # a short one whole
            pool.close()
            pool = linear_mod.MatmulPool("split", 1)  # num_parts 1: the serial path
            monkeypatch.setattr(linear_mod, "_active", pool)
        assert len(plans[-1].prefill_parts) == 1 and len(plans[-1].decode_parts) == 1
    finally:
        pool.close()
    for seq in histories:
        np.testing.assert_allclose(got[True][seq], got[False][seq], atol=1e-5, rtol=1e-6)
        close(got[True][seq], reference_logits(tiny_path, histories[seq] + new[seq])[-len(new[seq]):])


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_row_parallel_layers_equal_the_column_split(tiny: LlamaModel, tiny_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, num_threads: int) -> None:
    """A step of many tokens runs its layers row by row over the pool (in tiles): the same logits as
    the column-split path, for prefill chunks and decodes mixed."""
    histories = {"a": PROMPT[:6], "b": PROMPT[:9]}
    new = {"a": [11], "b": PROMPT[:7], "c": (PROMPT * 2)[:17]}
    got = {}
    pool = linear_mod.MatmulPool("split", num_threads)
    monkeypatch.setattr(linear_mod, "_active", pool)
    monkeypatch.setattr(model_mod, "ROW_TILE", 4)
    calls: list[int] = []
    real_parts = model_mod._row_parts

    def spy(num_tokens: int, num_parts: int) -> list[list[tuple[int, int]]]:
        parts = real_parts(num_tokens, num_parts)
        rows = [r for part in parts for lo, hi in part for r in range(lo, hi)]
        assert rows == list(range(num_tokens)) and len(parts) == min(num_parts, num_tokens)
        assert all(hi - lo <= 4 for part in parts for lo, hi in part)
        calls.append(len(parts))
        return parts

    monkeypatch.setattr(model_mod, "_row_parts", spy)
    try:
        for min_rows in (1, 10**9):                   # row-parallel, then the column split
            monkeypatch.setattr(model_mod, "MIN_ROW_SPLIT_TOKENS", min_rows)
            pager = Pager(tiny, seed=3)
            pager.step(list(histories.items()))
            got[min_rows] = pager.step(list(new.items()))
    finally:
        pool.close()
    assert calls == [num_threads, num_threads]        # both steps of the first pass, none after
    for seq in new:
        np.testing.assert_allclose(got[1][seq], got[10**9][seq], atol=1e-5, rtol=1e-6)
        close(got[1][seq], reference_logits(tiny_path, histories.get(seq, []) + new[seq])[-len(new[seq]):])


def test_only_sampled_rows_are_returned(tiny: LlamaModel, reference: np.ndarray) -> None:
    n = len(PROMPT)
    kv = tiny.new_kv_cache(8, BLOCK_SIZE)
    batch = ForwardBatch(
        token_ids=np.array(PROMPT), positions=np.arange(n), slot_mapping=np.arange(n),
        query_start=np.array([0, n]), context_lens=np.array([n]), block_tables=np.arange(3)[None],
        sample_indices=np.array([n - 1, 2]),
    )
    close(tiny.forward(batch, kv), reference[[n - 1, 2]])
    batch.sample_indices = np.array([], dtype=np.int64)
    assert tiny.forward(batch, kv).shape == (0, 64)
    empty = np.array([], dtype=np.int64)
    nothing = ForwardBatch(token_ids=empty, positions=empty, slot_mapping=empty, query_start=np.array([0]),
                           context_lens=empty, block_tables=np.zeros((0, 1), dtype=np.int64), sample_indices=empty)
    assert tiny.forward(nothing, kv).shape == (0, 64)


@pytest.mark.parametrize(("quant", "kv_heads", "tied"), [("Q8_0", 2, True), ("F16", 4, False), ("F32", 1, False)])
def test_other_files_match_reference(tmp_path: Path, quant: str, kv_heads: int, tied: bool) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", quant=quant, kv_heads=kv_heads, tied=tied, ffn=64, seed=7)
    model = LlamaModel.load(path)
    assert model.config.tied_embeddings is tied
    pager = Pager(model, seed=6)
    got = [pager.step([("a", PROMPT[:5])])["a"]] + [pager.step([("a", [t])])["a"] for t in PROMPT[5:]]
    close(np.concatenate(got), reference_logits(path, PROMPT))


def test_kv_cache_shape_and_size(tiny: LlamaModel) -> None:
    kv = tiny.new_kv_cache(10, BLOCK_SIZE)
    assert isinstance(kv, KVCache)
    assert kv.k.shape == kv.v.shape == (2, 10, BLOCK_SIZE, 2, 8) and kv.k.dtype == np.float32
    assert KVCache.bytes_per_block(tiny.config, BLOCK_SIZE) * 10 == kv.k.nbytes + kv.v.nbytes


def test_inconsistent_batch_is_an_engine_error(tiny: LlamaModel) -> None:
    kv = tiny.new_kv_cache(4, BLOCK_SIZE)
    batch = ForwardBatch(
        token_ids=np.array([1, 99]), positions=np.array([0, 1]), slot_mapping=np.array([0, 1]),
        query_start=np.array([0, 2]), context_lens=np.array([2]), block_tables=np.array([[0]]),
        sample_indices=np.array([1]),
    )
    with pytest.raises(EngineError, match="token id"):
        tiny.forward(batch, kv)
    with pytest.raises(InvalidRequest):
        tiny.forward_context([])


# -- loading errors ---------------------------------------------------------------------------

def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        LlamaModel.load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    assert "not found" in _load_error(tmp_path / "nope.gguf")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert "GGUF" in _load_error(path)


def test_truncated_file(tmp_path: Path, tiny_path: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_path.read_bytes()[:3000])
    _load_error(path)


def test_wrong_architecture(tmp_path: Path) -> None:
    assert "gpt2" in _load_error(write_tiny_llama(tmp_path / "g.gguf", arch="gpt2"))


def test_missing_tensor(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", omit=("blk.1.ffn_up.weight",))
    assert "blk.1.ffn_up.weight" in _load_error(path)


# -- the real default model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(default_model_path: Path) -> tuple[LlamaModel, float, list[str]]:
    started = time.perf_counter()
    reader = read_gguf(default_model_path)
    model = LlamaModel.from_reader(reader, default_model_path)
    load_s = time.perf_counter() - started
    return model, load_s, list(reader.metadata["tokenizer.ggml.tokens"])


def test_real_model_says_paris(real: tuple[LlamaModel, float, list[str]], default_model_path: Path) -> None:
    model, _, tokens = real
    c = model.config
    assert c.name == default_model_path.name
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads) == (30, 576, 1536, 9, 3)
    assert (c.head_dim, c.rope_theta, c.max_position, c.vocab_size) == (64, 100000.0, 8192, 49152)
    assert (c.bos_token_id, c.eos_token_id, c.tied_embeddings) == (1, 2, True)
    assert abs(c.rms_eps - 1e-5) < 1e-9
    ids = {tok: i for i, tok in enumerate(tokens)}
    prompt = [ids[t] for t in ("The", "Ġcapital", "Ġof", "ĠFrance", "Ġis")]
    best = int(np.argmax(model.forward_context(prompt)))
    assert tokens[best].replace("Ġ", " ") == " Paris"


def test_gather_views_a_run_of_consecutive_blocks_and_copies_the_rest() -> None:
    cache = np.arange(10 * 2 * 3, dtype=np.float32).reshape(10, 2, 3)     # [blocks, block_size, ...]
    scratch = kv_cache.Scratch()
    for ids, is_view in (([4], True), ([4, 5, 6], True), ([[4, 5, 6]], True), ([4, 6, 5], False),
                         ([4, 6], False), ([[1, 2], [3, 4]], False), ([7, 8, 6], False)):
        block_ids = np.array(ids, dtype=np.int64)
        got = scratch.gather(0, cache, block_ids)
        assert np.array_equal(got, cache[block_ids]), ids
        assert np.shares_memory(got, cache) == is_view, ids
