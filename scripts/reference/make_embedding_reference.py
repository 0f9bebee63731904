"""Produce tests/data/minilm_reference.json: sentence-transformers' vectors of all-MiniLM-L6-v2 for 50 texts,
which forge's numpy BERT encoder (forge/models/bert/) is tested against (tests/unit/test_bert.py).

The texts cover ASCII, accents, CJK, emoji, whitespace and punctuation, single characters, and inputs past
the model's max_seq_length (256 tokens), which sentence-transformers truncates. Each case records the token ids
the model ran (truncated) and the vector as base64 of its little-endian float32 values (the exact output, 2 KB).

How to run it (NOT run by CI, and not a forge dependency: it needs torch and sentence-transformers, which live
in the reference venv that scripts/reference/refvenv.sh creates and prints the python of):

    "$(scripts/reference/refvenv.sh)" scripts/reference/make_embedding_reference.py [--model DIR] [--out PATH]

--model defaults to the directory `forge pull all-minilm-l6-v2` unpacks into $FORGE_HOME/models. A few seconds.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from forge.models.hub import CATALOG, forge_home  # noqa: E402  (the standard library alone: it runs in the reference venv)

NAME = "all-minilm-l6-v2"
LONG = " ".join(f"word{i} and another" for i in range(200))          # ~800 tokens: truncated at 256

TEXTS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world!", "a", "I", ".", "?", "7", "é", "東", "🙂",
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A monkey is playing drums.", "Stock markets fell sharply on Monday after the announcement.",
    "Café au lait, crème brûlée, naïve façade, jalapeño, Ångström, Øresund.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.", "¿Dónde está la biblioteca? ¡Aquí!",
    "東京は日本の首都です。", "我喜欢学习自然语言处理。", "한국어 문장도 하나 넣습니다.", "Привет, как дела?",
    "مرحبا بالعالم", "Emoji party 🎉🎉🔥💯 with 👩‍👩‍👧‍👦 families", "🙂🙃😉", "   leading and trailing spaces   ",
    "tabs\tand\nnewlines\r\nmixed", "ALL CAPS SHOUTING TEXT", "MiXeD CaSe WoRdS", "numbers 12345 67.89 -0.5 1e10",
    "email@example.com https://example.org/path?q=1", "C++ and C# and F# are languages; so is R.",
    "def f(x): return x ** 2  # a Python function", "<html><body>markup</body></html>", "!!!???...,,,;;;",
    "supercalifragilisticexpialidocious", "unbelievably antidisestablishmentarianism", "the the the the the",
    "What is the capital of France?", "Paris is the capital of France.", "Berlin is the capital of Germany.",
    "How do I reset my password?", "Click 'Forgot password' on the login page.",
    "Sentence embeddings map text to vectors.", LONG, "x " * 300, "Short then " + "long " * 400,
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=forge_home() / "models" / str(CATALOG[NAME].unpack_to))
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "minilm_reference.json")
    args = parser.parse_args()
    assert len(TEXTS) == 50, len(TEXTS)
    torch.set_num_threads(2)
    model = SentenceTransformer(str(args.model), device="cpu")
    vectors = model.encode(TEXTS, batch_size=8, convert_to_numpy=True)                   # [50, 384] normalised
    tokenizer = model.tokenizer
    cases = []
    for text, vector in zip(TEXTS, vectors, strict=True):
        ids = tokenizer(text, truncation=True, max_length=model.max_seq_length)["input_ids"]
        cases.append({"text": text, "ids": ids,
                      "vector": base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")})
    assert any(len(c["ids"]) == model.max_seq_length for c in cases)                    # some were truncated
    data = {"model": {"name": NAME, "sha256": CATALOG[NAME].sha256, "max_seq_length": model.max_seq_length,
                      "dimension": int(vectors.shape[1])},
            "versions": {"sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
            "cases": cases}
    args.out.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
