"""Produce tests/data/smollm2_reference.json: reference data that forge's numpy model and tokenizer are tested against.

What it writes: greedy continuations (48 tokens, with the top-1/top-2 logit gap of every step), top-5 next-token
log-probabilities, chat-template renderings and tokenizer cases, all computed by an independent float32
implementation of the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, dequantized to float32 on load).

How to run it (NOT run by CI, and not a forge dependency: it needs torch and transformers, which live in a separate
virtual environment, the reference venv, that scripts/reference/refvenv.sh creates and prints the python of):

    "$(scripts/reference/refvenv.sh)" scripts/reference/make_reference.py [--model PATH] [--out PATH]

--model defaults to the default model where `forge pull` puts it ($FORGE_HOME/models, by default ~/.cache/forge/models).

It takes 9 to 15 minutes on two shared cores (torch uses 2 threads). Every cached greedy run is cross-checked
against one full forward. The tokenizer that the GGUF loader builds is plain GPT-2 byte-level BPE; the
model's real pre-tokenizer first splits off every digit, so the script replaces the pre-tokenizer and then checks
the fix: "\\n\\n1." must become `ĊĊ 1 .` (two newlines merged into one token), not `Ċ Ċ 1 .`. It also checks that
there is no normalizer and that no BOS token is added.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from forge.models.hub import forge_home  # noqa: E402  (the standard library alone: it runs in the reference venv)

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL = forge_home() / "models" / MODEL_FILE
DEFAULT_OUT = ROOT / "tests" / "data" / "smollm2_reference.json"
NUM_GREEDY_TOKENS = 48
NUM_TOP_LOGPROBS = 5
BOS_ID = 1

LONG_PARAGRAPH = (
    "The history of the bicycle is a story of small improvements that added up to a machine which changed how "
    "people lived. The earliest designs, built in the early nineteenth century, had no pedals at all: riders pushed "
    "themselves along with their feet, like children on a balance bike. Later inventors attached cranks and pedals "
    "directly to the front wheel, which made the front wheel grow larger and larger, because a bigger wheel covered "
    "more ground with each turn of the pedals. These tall machines were fast but dangerous, and a fall from one could "
    "cause serious injuries. The so-called safety bicycle solved the problem with a chain that drove the rear wheel, "
    "two wheels of equal size, and, soon after, air-filled rubber tyres that made the ride far more comfortable. "
    "Within a few years, millions of people could travel farther and faster than ever before. Workers could live "
    "farther from their factories, doctors could reach patients in distant villages, and young people discovered a "
    "new kind of freedom on the open road. In many cities, the bicycle soon became"
)

COMPLETION_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "import numpy as np\n\n# Compute the mean of each row of a matrix\ndef row_means(matrix):\n",
    "<html>\n  <head>\n    <title>",
    'SELECT name, age FROM users WHERE',
    "Shopping list:\n1. apples\n2.",
    "Steps to make tea:\n- Boil water\n-",
    "Question: A farmer has 12 cows and buys 7 more. Then he sells 5 of them. How many cows does he have now?\n"
    "Answer:",
    "2 + 2 = 4\n3 + 5 = 8\n7 + 6 =",
    "La capitale de l'Allemagne est",
    "Der schnellste Weg nach Hause ist",
    "El sol sale por el este y",
    "我最喜欢的食物是",
    "In 1969, Neil Armstrong",
    LONG_PARAGRAPH,
]

CHAT_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "List three fruits that are red."}],
    [{"role": "user", "content": "What is 15 + 27?"}],
    [
        {"role": "user", "content": "Hi! My name is Ana."},
        {"role": "assistant", "content": "Hello Ana! How can I help you today?"},
        {"role": "user", "content": "What is my name?"},
    ],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "Traduis en anglais : « Le chat dort sur le canapé. »"}],
]

CHAT_CASES: list[tuple[list[dict[str, str]], bool]] = [
    ([{"role": "user", "content": "Hello!"}], True),
    (
        [
            {"role": "system", "content": "You are a pirate."},
            {"role": "user", "content": "Where is the treasure?"},
        ],
        True,
    ),
    (
        [
            {"role": "user", "content": "Count to 3."},
            {"role": "assistant", "content": "1, 2, 3."},
            {"role": "user", "content": "Now backwards.\n\n1."},
        ],
        True,
    ),
    ([{"role": "user", "content": "No generation prompt here."}], False),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!"},
        ],
        False,
    ),
    ([{"role": "user", "content": "  spaces\tand tabs  \n"}], True),
]

TOKENIZER_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you doing today? I'm fine, thanks.",
    "def f(x):\n\treturn x  +  1\n\n\n",
    "if (a ==  b)    {\n        return;\n    }",
    "\t\tindented\twith\ttabs",
    "\n\n1.",
    "\n\n1. apples\n2. pears",
    " 2024",
    "a  12345",
    "In 2024, 3.14159 and 1,000,000 and -42.",
    "version 1.2.3-rc4",
    "١٢٣",
    "１２３",
    "x² + y³ = z¹⁰",
    "Ⅻ and ½ and ௫",
    "café naïve résumé Ångström",
    "Ça va? Größe, Straße, über.",
    "日本語のテキストです。",
    "我最喜欢的食物是饺子",
    "한국어 문장",
    "Привет, мир!",
    "مرحبا بالعالم",
    "emoji 😀 and family 👩‍👩‍👧 and flag 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "   leading spaces",
    "trailing spaces   ",
    "  both  ",
    " ",
    "\n",
    "",
    "a\x04b",
    "ctrl\x1dsep\x06end",
    "rare plane \U00050000 char",
    "https://example.com/path?query=1&x=y#frag",
    "CamelCaseIdentifier snake_case_identifier",
    "'s 't 're 've 'm 'll 'd",
    "....!!!???",
    "\r\nWindows line\r\n",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fix_tokenizer(tok: Any) -> None:
    """Give the tokenizer the model's real pre-tokenizer, then check the three facts the tests rely on."""
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    # Digits split off first, so the two newlines stay one pre-token and merge: "ĊĊ 1 ." (not "Ċ Ċ 1 .").
    pieces = tok.convert_ids_to_tokens(encode(tok, "\n\n1."))
    if pieces != ["ĊĊ", "1", "."]:
        sys.exit(f"pre-tokenizer fix did not take effect: {pieces}")
    if backend.normalizer is not None:
        sys.exit(f"unexpected normalizer: {backend.normalizer}")
    with_special = tok("hi", add_special_tokens=True)["input_ids"]
    if with_special != encode(tok, "hi") or with_special[0] == BOS_ID:
        sys.exit(f"tokenizer adds special tokens: {with_special}")


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def bytes_without_token(tok: Any) -> list[int]:
    """Byte values whose byte-level character (GPT-2 byte-to-unicode mapping) is not in the vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    vocab = tok.get_vocab()
    return [b for b in range(256) if chars[b] not in vocab]


@torch.no_grad()
def greedy(model: Any, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """48 greedy steps with the KV cache, never stopping early (runs past eos), then checked."""
    input_ids = torch.tensor([prompt_ids])
    out = model(input_ids=input_ids, use_cache=True)
    output_ids: list[int] = []
    gaps: list[float] = []
    for _ in range(NUM_GREEDY_TOKENS):
        logits = out.logits[0, -1].float()  # [vocab]
        top = torch.topk(logits, 2)
        next_id = int(torch.argmax(logits))
        output_ids.append(next_id)
        gaps.append(round(float(top.values[0] - top.values[1]), 6))
        out = model(input_ids=torch.tensor([[next_id]]), cache=out.cache, use_cache=True)
    check_against_recompute(model, prompt_ids, output_ids, gaps)
    return output_ids, gaps


@torch.no_grad()
def check_against_recompute(model: Any, prompt_ids: list[int], output_ids: list[int], gaps: list[float]) -> None:
    """The cached steps must agree with one full forward over prompt + output (argmax wherever it is not a near-tie)."""
    full = torch.tensor([prompt_ids + output_ids[:-1]])
    logits = model(input_ids=full, use_cache=False).logits[0, len(prompt_ids) - 1 :].float()  # [48, vocab]
    argmax_ids = torch.argmax(logits, dim=-1).tolist()
    for step, (cached_id, full_id, gap) in enumerate(zip(output_ids, argmax_ids, gaps, strict=False)):
        if cached_id != full_id and gap > 1e-3:
            sys.exit(f"cached greedy step {step} gave {cached_id}, full recompute {full_id} (gap {gap})")


@torch.no_grad()
def top_logprobs(model: Any, prompt_ids: list[int]) -> list[list[float]]:
    """Top-5 log_softmax of the float32 logits after the whole prompt (one full forward, no cache)."""
    logits = model(input_ids=torch.tensor([prompt_ids]), use_cache=False).logits[0, -1].float()  # [vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, NUM_TOP_LOGPROBS)
    return [[int(i), round(float(v), 6)] for v, i in zip(top.values, top.indices, strict=False)]


def render_chat(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(text, str)
    return text


def dump(data: dict[str, Any], path: Path) -> None:
    """One case per line, so that a regeneration diffs readably."""
    lines = ["{"]
    keys = list(data)
    for n, key in enumerate(keys):
        comma = "," if n < len(keys) - 1 else ""
        value = data[key]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f"  {json.dumps(key)}: [")
            for m, item in enumerate(value):
                item_comma = "," if m < len(value) - 1 else ""
                lines.append("    " + json.dumps(item, ensure_ascii=False) + item_comma)
            lines.append("  ]" + comma)
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
    lines.append("}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    args = parse_args()
    started = time.monotonic()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    if sha256_of(args.model) != MODEL_SHA256:
        sys.exit(f"{args.model}: sha256 differs from {MODEL_SHA256}")
    model_dir, model_name = str(args.model.parent), args.model.name

    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_name)
    fix_tokenizer(tok)
    # `dtype` is the current name of the older `torch_dtype` argument (which now logs a deprecation warning).
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=model_name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    print(f"loaded in {time.monotonic() - started:.1f}s", flush=True)

    prompts = list(COMPLETION_PROMPTS) + [render_chat(tok, m, True) for m in CHAT_PROMPTS]
    greedy_cases = []
    for prompt in prompts:
        prompt_ids = encode(tok, prompt)
        output_ids, gaps = greedy(model, prompt_ids)
        greedy_cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "output_ids": output_ids, "top2_gap": gaps})
        head = tok.decode(output_ids[:24])
        print(f"[{len(prompt_ids):3d} ids] {prompt[-40:]!r} -> {head!r}", flush=True)

    # Positions after a prompt, and further into a generated continuation (prompt + first k generated ids).
    logprob_ids = [greedy_cases[i]["prompt_ids"] for i in (0, 4, 8, 12, 17, 18)]
    logprob_ids += [greedy_cases[i]["prompt_ids"] + greedy_cases[i]["output_ids"][:k] for i, k in ((0, 5), (18, 12))]
    logprob_cases = [{"prompt_ids": ids, "top5": top_logprobs(model, ids)} for ids in logprob_ids]

    chat_cases = []
    for messages, add_generation_prompt in CHAT_CASES:
        text = render_chat(tok, messages, add_generation_prompt)
        chat_cases.append(
            {
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "text": text,
                "ids": encode(tok, text),
            }
        )

    data = {
        "model": {"file": MODEL_FILE, "sha256": MODEL_SHA256},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "num_greedy_tokens": NUM_GREEDY_TOKENS,
        "bytes_without_token": bytes_without_token(tok),
        "greedy": greedy_cases,
        "logprobs": logprob_cases,
        "chat": chat_cases,
        "tokenizer": [{"text": text, "ids": encode(tok, text)} for text in TOKENIZER_TEXTS],
    }
    dump(data, args.out)
    size_kb = args.out.stat().st_size / 1024
    print(f"wrote {args.out} ({size_kb:.0f} KB) in {time.monotonic() - started:.1f}s", flush=True)
    if size_kb > 300:
        sys.exit("reference file is over 300 KB")


if __name__ == "__main__":
    main()
