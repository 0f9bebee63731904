"""Produce the reference data forge's model families are tested against, with Hugging Face transformers.

    tests/data/tiny_families_reference.json   per family (tests/tiny_families.SPECS: the dense ones and
        the mixtures of experts qwen3moe, olmoe, qwen2moe, Mixtral): a tiny random
        checkpoint (tests/tiny_families.py) loaded into the family's transformers model; its float32
        logits at every position of a 20-token input
    tests/data/rope_scaling_reference.json    per long-context RoPE case (YaRN, LongRoPE: tiny_families.
        ROPE_SCALING_SPECS): the same, at every position of an input past the original context; LongRoPE also
        on the input's first original-context tokens, where transformers takes the short factors
    tests/data/spm_tokenizer_reference.json   a SentencePiece BPE model of 700 pieces trained here by
        the sentencepiece library (as Llama 2's was: byte fallback, dummy prefix, split digits), its
        pieces stored as Llama 2 / Mistral / TinyLlama GGUF files store theirs, and the ids and
        decodings sentencepiece gives a corpus (plus the texts where transformers' GGUF loader,
        whose Metaspace pre-tokenizer adds no prefix to a text that starts with a space, differs)
    tests/data/bpe_pretokenizer_reference.json  a byte-level BPE vocabulary trained here, stored as a
        GGUF 'gpt2' tokenizer under the pre-tokenizer names `qwen2` and `llama-bpe`; transformers' ids;
        and under `gpt-4o` (GPT-4o's and gpt-oss's o200k split, which transformers' GGUF loader does not
        know): the ids of tiktoken itself, its o200k pattern over the same vocabulary
    tests/data/gemma3_270m_reference.json     the real Gemma 3 270M Q4_K_M file (`forge pull
        gemma-3-270m`) loaded by transformers from the GGUF: greedy continuations with the top-2 gap of
        every step, top-5 logprobs (one case past the 512-token sliding window) and the encodings of a
        tokenizer corpus

How to run it (NOT run by CI, and not a forge dependency: it needs torch and transformers, which live in a
separate virtual environment, the reference venv, that scripts/reference/refvenv.sh creates and prints the python of):

    "$(scripts/reference/refvenv.sh)" scripts/reference/make_family_reference.py [--only tiny|rope|spm|bpe|gemma3]

The Gemma file is read where `forge pull gemma-3-270m` puts it ($FORGE_HOME/models, by default ~/.cache/forge/models).

About 2 minutes on two cores (most of it loading Gemma). Every cached greedy run is cross-checked
against one full forward.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from forge.models.hub import model_path  # noqa: E402
from scripts.reference.make_reference import COMPLETION_PROMPTS, LONG_PARAGRAPH, dump, sha256_of  # noqa: E402
from scripts.reference.make_reference import TOKENIZER_TEXTS as SMOLLM_TOKENIZER_TEXTS  # noqa: E402
from tests import tiny_families  # noqa: E402

GEMMA_FILE = model_path("gemma-3-270m")
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NUM_GREEDY_TOKENS = 32
NUM_TOP_LOGPROBS = 5

GEMMA_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "Shopping list:\n1. apples\n2.",
    "2 + 2 = 4\n3 + 5 = 8\n7 + 6 =",
    "La capitale de l'Allemagne est",
    "我最喜欢的食物是",
    "<start_of_turn>user\nWhat is the capital of Italy?<end_of_turn>\n<start_of_turn>model\n",
    " ".join([LONG_PARAGRAPH] * 3),      # about 650 tokens: past the 512-token sliding window
]

TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello  world",
    "   leading spaces and trailing spaces   ",
    "def f(x):\n\treturn x  +  1\n\n\n",
    "if (a ==  b)    {\n        return;\n    }",
    "In 2024, 3.14159 and 1,000,000 and -42.",
    "١٢٣ and １２３ and x² + y³",
    "café naïve résumé Ångström, Größe, Straße",
    "日本語のテキストです。我最喜欢的食物是饺子。한국어 문장",
    "Привет, мир! مرحبا بالعالم",
    "emoji 😀 and family 👩‍👩‍👧 and flag 🇫🇷",
    "rare plane \U00050000 char and control \x04 byte",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<bos><eos><pad>",
    "https://example.com/path?query=1&x=y#frag",
    "CamelCaseIdentifier snake_case_identifier",
    " ",
    "\n",
    "",
    "\r\nWindows line\r\n",
]


def tiny_model(family: str) -> Any:
    """The family's transformers model holding the tiny checkpoint's weights. A mixture of experts
    goes through a saved checkpoint and from_pretrained: transformers stacks the per-expert tensors
    into its own fused parameters there (its checkpoint conversion), as it does for a released model."""
    spec = tiny_families.spec(family)
    config = AutoConfig.for_model(spec.hf_model_type, **tiny_families.hf_config(family))
    state = {k: torch.from_numpy(v) for k, v in tiny_families.state_dict(family).items()}
    if spec.experts:
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            save_file(state, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
            model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager",
                                                               output_loading_info=True)
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        missing = [*missing, *info.get("mismatched_keys", [])]
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
        missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (spec.tied and k == "lm_head.weight")]
    if missing or unexpected:
        sys.exit(f"{family}: checkpoint names differ from the model's: missing {missing}, unexpected {unexpected}")
    return model


@torch.no_grad()
def tiny_case(family: str, ids: list[int] | None = None) -> dict[str, Any]:
    spec = tiny_families.spec(family)
    model = tiny_model(family)
    model.eval()
    ids = tiny_families.input_ids(family) if ids is None else ids
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()     # [T, V]
    print(f"{family}: {type(model).__name__}, {len(ids)} ids, logits {tuple(logits.shape)}, "
          f"|max| {float(logits.abs().max()):.3f}")
    case = {"family": family, "model_class": type(model).__name__, "input_ids": ids,
            "logits": [[round(float(x), 6) for x in row] for row in logits]}
    rope = spec.hf_extra.get("rope_parameters", {})
    if rope.get("rope_type") == "longrope":     # which factors this forward took (by its longest position)
        original = spec.hf_extra["original_max_position_embeddings"]
        inv_freq = model.model.rotary_emb.inv_freq.double()
        base = rope["rope_theta"] ** (-torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim)
        factors = "long" if len(ids) > original else "short"
        if not torch.allclose(inv_freq, base / torch.tensor(rope[f"{factors}_factor"], dtype=torch.float64)):
            sys.exit(f"{family}: {len(ids)} ids did not take the {factors} factors")
        case.update(factors=factors, served_context=spec.context if factors == "long" else original)
    return case


def rope_scaling_cases() -> list[dict[str, Any]]:
    """Every long-context case past its original context; LongRoPE's also within it (the short factors)."""
    cases = []
    for family, spec in tiny_families.ROPE_SCALING_SPECS.items():
        cases.append(tiny_case(family))
        if spec.hf_extra["rope_parameters"]["rope_type"] == "longrope":
            original = spec.hf_extra["original_max_position_embeddings"]
            cases.append(tiny_case(family, tiny_families.input_ids(family)[:original]))
    return cases


@torch.no_grad()
def greedy(model: Any, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """NUM_GREEDY_TOKENS greedy steps with the KV cache (past eos), cross-checked by a full forward."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    output_ids: list[int] = []
    gaps: list[float] = []
    for _ in range(NUM_GREEDY_TOKENS):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        output_ids.append(int(top.indices[0]))
        gaps.append(round(float(top.values[0] - top.values[1]), 6))
        out = model(input_ids=torch.tensor([[output_ids[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    full = model(input_ids=torch.tensor([prompt_ids + output_ids[:-1]]), use_cache=False).logits[0]
    full = full[len(prompt_ids) - 1:]
    for step, (cached, recomputed, gap) in enumerate(zip(output_ids, full.argmax(-1).tolist(), gaps, strict=True)):
        if cached != recomputed and gap > 1e-3:
            sys.exit(f"cached greedy step {step} gave {cached}, a full forward {recomputed} (gap {gap})")
    return output_ids, gaps


@torch.no_grad()
def top_logprobs(model: Any, ids: list[int]) -> list[list[float]]:
    logprobs = torch.log_softmax(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
    top = torch.topk(logprobs, NUM_TOP_LOGPROBS)
    return [[int(i), round(float(v), 6)] for v, i in zip(top.values, top.indices, strict=True)]


def spm_reference() -> dict[str, Any]:
    """Train a small SentencePiece BPE model with the sentencepiece library (as Llama 2's was made:
    byte fallback, a dummy prefix, digits split, whitespace kept), store its pieces as
    convert_hf_to_gguf.py stores Llama 2's, and record the ids sentencepiece itself gives a corpus."""
    import io
    import tempfile

    import sentencepiece as spm

    corpus = [LONG_PARAGRAPH, *COMPLETION_PROMPTS, *GEMMA_PROMPTS[:-1], *TOKENIZER_TEXTS, *SMOLLM_TOKENIZER_TEXTS]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for text in corpus * 3 for line in text.splitlines() if line.strip()]),
        model_writer=model, model_type="bpe", vocab_size=700, byte_fallback=True, split_digits=True,
        add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = []
    for i in range(sp.get_piece_size()):
        kind = 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
        vocab.append({"piece": sp.id_to_piece(i), "score": float(sp.get_score(i)), "type": kind})
    texts = [*TOKENIZER_TEXTS, *SMOLLM_TOKENIZER_TEXTS[:12], " leading", "  two leading", "line\n next"]
    cases = [{"text": text, "ids": [1, *sp.encode(text)], "decoded": sp.decode(sp.encode(text))} for text in texts]
    with tempfile.TemporaryDirectory() as tmp:           # what transformers' GGUF loader makes of it, for the record
        path = tiny_families.write_spm_tokenizer_gguf(Path(tmp) / "spm.gguf", vocab)
        tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
        differ = [c["text"] for c in cases if list(tok(c["text"]).input_ids) != c["ids"]]
    print(f"spm: {len(vocab)} pieces, {len(cases)} cases; transformers' GGUF tokenizer differs on {differ!r}")
    return {"versions": {"sentencepiece": spm.__version__}, "vocab": vocab, "cases": cases,
            "transformers_differs_on": differ}


def bpe_reference() -> dict[str, Any]:
    """A byte-level BPE vocabulary trained here (tokenizers' trainer), stored as GGUF 'gpt2' files
    store theirs, under each pre-tokenizer name forge knows (`qwen2`, `llama-bpe`); the ids
    transformers' GGUF loader gives a corpus with each."""
    import tempfile

    import gguf

    trainer_model = tokenizers.ByteLevelBPETokenizer()
    corpus = [LONG_PARAGRAPH, *COMPLETION_PROMPTS, *GEMMA_PROMPTS[:-1], *TOKENIZER_TEXTS, *SMOLLM_TOKENIZER_TEXTS]
    trainer_model.train_from_iterator(corpus * 3, vocab_size=900, min_frequency=2, show_progress=False,
                                      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    state = json.loads(trainer_model._tokenizer.to_str())["model"]
    tokens = [piece for piece, _ in sorted(state["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    texts = [*TOKENIZER_TEXTS, *SMOLLM_TOKENIZER_TEXTS[:14], "12345678 and 2024-12-01"]
    out: dict[str, Any] = {"tokens": tokens, "merges": merges, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in ("qwen2", "llama-bpe"):
            path = Path(tmp) / f"{pre}.gguf"
            writer = gguf.GGUFWriter(path, "qwen2")
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre(pre)
            writer.add_token_list(tokens)
            writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
            writer.add_token_merges(merges)
            writer.add_eos_token_id(0)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
            out["cases"][pre] = [{"text": t, "ids": list(tok(t, add_special_tokens=False).input_ids)} for t in texts]
    texts += ["camelCaseWords and HTTPServer's getURL()", "don't, YOU'LL, We'Re", "path/to/file/\nnext/\r\n",
              "ÉCOLE école Straße İstanbul", "x1234567 9/11"]      # where o200k's split differs from Llama 3's
    out["cases"]["gpt-4o"] = [{"text": t, "ids": ids} for t, ids in zip(texts, o200k_ids(tokens, texts), strict=True)]
    print(f"bpe: {len(tokens)} tokens, {len(merges)} merges")
    return out


def o200k_ids(tokens: list[str], texts: list[str]) -> list[list[int]]:
    """The ids tiktoken gives each text under o200k's split (its own pattern: o200k_base's, read with the
    download of OpenAI's ranks skipped) with the trained vocabulary as its ranks (a token's rank its id:
    the trainer numbers merged tokens in merge order, so tiktoken's lowest-rank-first merging is BPE's)."""
    import tiktoken
    from tiktoken_ext import openai_public
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    def no_download(*_args: Any, **_kwargs: Any) -> dict[bytes, int]:
        return {}

    download = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = no_download
    try:
        pattern = openai_public.o200k_base()["pat_str"]
    finally:
        openai_public.load_tiktoken_bpe = download
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[c] for c in t): i for i, t in enumerate(tokens) if not t.startswith("<|")}
    encoding = tiktoken.Encoding("tiny-o200k", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
    return [encoding.encode_ordinary(t) for t in texts]


def gemma3_reference() -> dict[str, Any]:
    if sha256_of(GEMMA_FILE) != GEMMA_SHA256:
        sys.exit(f"{GEMMA_FILE}: sha256 differs from {GEMMA_SHA256} (run `forge pull gemma-3-270m`)")
    tok = AutoTokenizer.from_pretrained(str(GEMMA_FILE.parent), gguf_file=GEMMA_FILE.name)
    model = AutoModelForCausalLM.from_pretrained(str(GEMMA_FILE.parent), gguf_file=GEMMA_FILE.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    model.eval()
    greedy_cases = []
    for prompt in GEMMA_PROMPTS:
        prompt_ids = list(tok(prompt).input_ids)            # with <bos>, as the file asks
        output_ids, gaps = greedy(model, prompt_ids)
        greedy_cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "output_ids": output_ids, "top2_gap": gaps})
        print(f"[{len(prompt_ids):3d} ids] {prompt[-30:]!r} -> {tok.decode(output_ids[:16])!r}", flush=True)
    logprob_ids = [c["prompt_ids"] for c in greedy_cases[:3]] + [greedy_cases[-1]["prompt_ids"]]
    logprob_ids.append(greedy_cases[0]["prompt_ids"] + greedy_cases[0]["output_ids"][:6])
    return {
        "model": {"file": GEMMA_FILE.name, "sha256": GEMMA_SHA256},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "num_greedy_tokens": NUM_GREEDY_TOKENS,
        "greedy": greedy_cases,
        "logprobs": [{"prompt_ids": ids, "top5": top_logprobs(model, ids)} for ids in logprob_ids],
        "tokenizer": [{"text": text, "ids": list(tok(text).input_ids)} for text in TOKENIZER_TEXTS],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "rope", "spm", "bpe", "gemma3"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.monotonic()
    if args.only in (None, "tiny"):
        out = ROOT / "tests" / "data" / "tiny_families_reference.json"
        dump({"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "cases": [tiny_case(family) for family in tiny_families.SPECS]}, out)
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")
    if args.only in (None, "rope"):
        out = ROOT / "tests" / "data" / "rope_scaling_reference.json"
        dump({"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "cases": rope_scaling_cases()}, out)
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")
    if args.only in (None, "spm"):
        out = ROOT / "tests" / "data" / "spm_tokenizer_reference.json"
        dump(spm_reference(), out)
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")
    if args.only in (None, "bpe"):
        out = ROOT / "tests" / "data" / "bpe_pretokenizer_reference.json"
        dump(bpe_reference(), out)
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")
    if args.only in (None, "gemma3"):
        out = ROOT / "tests" / "data" / "gemma3_270m_reference.json"
        dump(gemma3_reference(), out)
        print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")
    print(f"done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
