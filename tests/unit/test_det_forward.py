"""The deterministic numerics' forward besides attention and the products (forge.models.llama.det_forward),
and its log-probabilities and sampling weights: a one-token forward of the real models gives the same logits,
bit for bit, under every build level this host can run (one key: attention is exact there; longer prompts
wait on attention's own deterministic kernel); RoPE by its explicit float32 operations; a mixture's router by
fixed operations, close to the float64 truth; the Sampler's logprobs and weights det_rowwise's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forge.kernels import det_rowwise
from forge.kernels.det_math import det_exp
from forge.kernels.quant_linear import BlockMatrix
from forge.models.llama import det_forward
from forge.models.llama.experts import MoeWeights
from forge.models.llama.linear import matmul_unsplit
from forge.models.llama.llama_config import MoeConfig
from forge.models.llama.mixture import mixture, route
from forge.models.llama.rope import apply_rope, apply_rope_exact
from forge.sampling.sampler import Sampler, token_logprobs
from forge.sampling.sampling_params import SamplingParams
from tests import tiny_families
from tests.unit.test_block_linear import RUNNABLE
from tests.unit.test_det_math import bits
from tests.unit.test_moe import Q, _stack, naive_mixture
from tests.unit.test_sampling import make_batch

ROOT = Path(__file__).resolve().parents[2]
FORWARD = ("import sys, numpy as np; from forge.kernels import choose_kernels, compiled;"
           "from forge.models.llama.llama_model import LlamaModel;"
           "m = LlamaModel.load(sys.argv[1], choose_kernels('blocks', 'deterministic'));"
           "assert m.det and compiled.status().startswith('compiled'), compiled.status();"
           "m.head_logits = (lambda h: h) if sys.argv[4] == 'hidden' else m.head_logits;"
           "np.save(sys.argv[2], m.forward_context([int(sys.argv[3])]))")


@pytest.mark.parametrize("which", ["default", "gemma3", "qwen2moe", "olmoe", "gemma2"])
def test_a_one_token_forward_is_the_same_on_every_level(which: str, tmp_path: Path, request: pytest.FixtureRequest,
                                                        ) -> None:
    """Norms, activations, RoPE, embedding scale, the products and the head at position 0, in a process per build
    level (FORGE_KERNEL_ISA): the default model (SmolLM2), Gemma 3 (QK-norm, sandwich norms, GELU), and tiny
    random Q8_0 files of qwen2moe (a float32 router, a shared expert and its gate), OLMoE (QK-norm over whole
    projections) and Gemma 2 (sandwich norms, GELU). The tiny files' head is their float32 embedding, which the
    deterministic product does not read (the reference product's bits depend on the level): of those, the final
    normed hidden state is compared, the head's input."""
    if which in ("default", "gemma3"):
        path = request.getfixturevalue("default_model_path" if which == "default" else "gemma3_model_path")
        token, what = 504, "logits"
    else:
        path, token, what = tiny_families.write_gguf(which, tmp_path / "tiny.gguf", quant="Q8_0"), 5, "hidden"
    logits = {}
    for isa in RUNNABLE:
        out = tmp_path / f"{isa}.npy"
        done = subprocess.run([sys.executable, "-c", FORWARD, str(path), str(out), str(token), what],
                              capture_output=True,
                              text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, "FORGE_KERNEL_ISA": isa, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr[-2000:]
        logits[isa] = np.load(out)
    assert len(logits) >= 2 and np.isfinite(logits["native"]).all()
    for isa, got in logits.items():
        assert np.array_equal(bits(got), bits(logits["native"])), isa


def test_rope_exact_is_its_float32_operations_and_close_to_the_complex_product() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 10)).astype(np.float32)                  # rope_dim 8 of head_dim 10
    angles = rng.uniform(-3, 3, (3, 1, 4))
    rotation = (np.cos(angles) + 1j * np.sin(angles)).astype(np.complex64)
    got, want = x.copy(), x.copy()
    apply_rope_exact(got, rotation)
    apply_rope(want, rotation)
    c, s = rotation.real, rotation.imag
    x0, x1 = x[..., 0:8:2], x[..., 1:8:2]
    assert np.array_equal(got[..., 0:8:2], (x0 * c) - (x1 * s))
    assert np.array_equal(got[..., 1:8:2], (x0 * s) + (x1 * c))
    assert np.array_equal(got[..., 8:], x[..., 8:])
    assert np.allclose(got, want, atol=1e-6)


def test_the_router_is_deterministic_and_a_mixture_stays_close_to_the_truth() -> None:
    rng = np.random.default_rng(1)
    experts, hidden, ffn, top_k = 6, 64, 32, 2
    x = rng.standard_normal((5, hidden)).astype(np.float32)
    router = (rng.standard_normal((experts, hidden)) / 8).astype(np.float32)

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    gate_up, (gate, up) = _stack([mat(experts, ffn, hidden), mat(experts, ffn, hidden)], Q.Q8_0, True)
    down_stack, (down,) = _stack([mat(experts, hidden, ffn)], Q.Q8_0, True)
    shared = (mat(ffn, hidden), mat(ffn, hidden), mat(hidden, ffn), mat(1, hidden))
    moe = MoeWeights(router=BlockMatrix([(router.view(np.uint8), 0)], hidden), gate_up=gate_up, down=down_stack,
                     shared_gate_up=np.ascontiguousarray(np.concatenate(shared[:2]).T), shared_down=shared[2].T,
                     shared_gate=np.ascontiguousarray(shared[3].T))
    assert np.array_equal(det_forward.product(x, moe.router), det_rowwise.matmul_f32_def(x, router))
    assert np.array_equal(det_forward.product(x, moe.shared_gate), det_rowwise.matmul_f32_def(x, shared[3]))
    config = MoeConfig(num_experts=experts, num_used=top_k, expert_ffn=ffn, norm_top_k=True)
    got = mixture(x, moe, config, matmul_unsplit, lambda gate_up: det_forward.gated(gate_up, "silu"), det=True)
    want = naive_mixture(x, router, gate, up, down, top_k, True, shared)
    np.testing.assert_allclose(got, want, atol=1e-4 * max(1.0, float(np.abs(want).max())), rtol=0)


def test_the_deterministic_route_breaks_ties_to_the_lower_id_and_renormalises_in_order() -> None:
    logits = np.array([[0.5, 2.0, 2.0, -1.0, 2.0], [3.0, -2.0, 0.0, 1.0, 0.5]], np.float32)
    ids, weights = det_forward.route(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 3]]
    probs = det_rowwise.softmax_def(logits)
    chosen = np.take_along_axis(probs, ids, axis=1)
    assert np.array_equal(weights, chosen / (chosen[:, 0] + chosen[:, 1])[:, None])
    ref_ids, ref_weights = route(logits[1:], 2, True)
    assert sorted(ref_ids[0].tolist()) == ids[1].tolist()
    assert np.allclose(np.sort(ref_weights[0]), np.sort(weights[1]), atol=1e-6)


def test_the_samplers_logprobs_and_weights_are_det_rowwises() -> None:
    rng = np.random.default_rng(2)
    logits = (rng.standard_normal((2, 1000)) * 4).astype(np.float32)
    logits[1, 7] = -np.inf                                                   # a banned token
    lse = det_rowwise.logsumexp_def(logits)
    for row, total in zip(logits, lse, strict=True):
        got = token_logprobs(row, 3, 2, det=True)
        assert got.logprob == float(row[3]) - float(total)
        assert abs(got.logprob - token_logprobs(row, 3, 2).logprob) < 1e-5
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=50, seed=2)]
    probs = Sampler(deterministic=True).probabilities(logits, make_batch(params))
    scaled = logits[0] / np.float32(0.7)
    weights = det_exp(scaled - scaled.max())
    assert np.allclose(probs[0], weights / weights.sum(dtype=np.float64), rtol=1e-6, atol=0)
    assert probs[1, 7] == 0.0 and np.count_nonzero(probs[1]) == 50
    reference = Sampler().probabilities(logits, make_batch(params))
    assert np.allclose(probs, reference, atol=1e-6)
    out = Sampler(deterministic=True).sample(logits, make_batch(params))
    assert all(probs[i, t] > 0 for i, t in enumerate(out.token_ids.tolist()))


def test_the_engine_serves_a_chunked_prompt_under_the_deterministic_numerics(default_model_path: Path) -> None:
    """Chunks of 7 tokens (most sample no row: none kept past the last attention) and the prompt whole give the
    same greedy tokens with their logprobs (close: attention is not yet the deterministic numerics')."""
    from forge.config import EngineConfig
    from forge.llm import LLMEngine, LoadedModel
    from forge.models.llama import KVCache
    from tests.unit.test_llm import greedy, run

    loaded = LoadedModel.load(str(default_model_path), kernels="blocks", numerics="deterministic")
    per_block = KVCache.bytes_per_block(loaded.model.config, 16) * 2
    prompt = loaded.tokenizer.encode("The deterministic numerics give the same bits whatever the batch. " * 3)
    results = []
    for budget in (7, 4096):
        config = EngineConfig(block_size=16, kv_cache_memory=64 * per_block, max_model_len=512,
                              enable_prefix_caching=False, max_num_batched_tokens=budget)
        results.append(run(LLMEngine(loaded, config), {"a": (prompt, greedy(6, ignore_eos=True, logprobs=2))})["a"])
    chunked, whole = results
    assert chunked.finish_reason == whole.finish_reason == "length"
    assert chunked.token_ids == whole.token_ids and len(chunked.logprobs) == 6
    for a, b in zip(chunked.logprobs, whole.logprobs, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-2


def test_ropes_exact_tables_are_within_float64_ulps_of_libms(default_model_path: Path) -> None:
    """forge.models.llama.exact_trig (the deterministic numerics' RoPE tables, the same on every host): its exp,
    log, power, cos and sin within a few float64 ulp of numpy's, and the default model's tables under the
    deterministic numerics within a float32 rounding of the reference's, the same rows where the angles agree."""
    from forge.kernels import choose_kernels
    from forge.models.llama import exact_trig
    from forge.models.llama.llama_model import LlamaModel

    rng = np.random.default_rng(3)
    a = np.concatenate([rng.uniform(-10, 10, 20000), rng.uniform(0, 2e5, 20000), [0.0, np.pi / 4, np.pi / 2]])
    cos, sin = exact_trig.cos_sin(a)
    assert np.abs(cos - np.cos(a)).max() < 5e-16 and np.abs(sin - np.sin(a)).max() < 5e-16
    assert cos[-3] == 1.0 and sin[-3] == 0.0
    x = rng.uniform(-30, 30, 20000)
    assert np.abs(exact_trig.exp(x) / np.exp(x) - 1).max() < 5e-16
    y = rng.uniform(1e-3, 1e7, 20000)
    assert np.abs(exact_trig.log(y) - np.log(y)).max() < 5e-15
    k = -np.arange(32) * 2.0 / 64
    assert np.abs(exact_trig.power(10000.0, k) / 10000.0 ** k - 1).max() < 5e-15
    det = LlamaModel.load(default_model_path, choose_kernels("blocks", "deterministic"))
    reference = LlamaModel.load(default_model_path, choose_kernels("blocks"))
    got, want = det.rope.rotation, reference.rope.rotation
    assert got.shape == want.shape and np.abs(got - want).max() < 1e-6
    assert np.count_nonzero(got != want) < 0.01 * got.size
