"""The peer arm of `scripts/ab/ab_embeddings.py library`: sentence-transformers on torch (CPU) embedding
the same texts with the same model directory, run in the reference venv (scripts/reference/refvenv.sh),
never in forge's. It loads the model once, then answers each line on stdin, `<batch> <count>`, with the
seconds `count` texts took in calls of `batch` (tokenizing included, as forge's arm), as one JSON line.

    "$(scripts/reference/refvenv.sh)" scripts/ab/embed_peer_st.py MODEL_DIR --threads 2 < commands
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a sentence-transformers directory (forge pull all-minilm-l6-v2 writes one)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--texts", required=True, help="a JSON file: the list of texts")
    args = p.parse_args()
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model, device="cpu")
    with open(args.texts) as f:
        texts: list[str] = json.load(f)
    model.encode(texts[:32], batch_size=32, normalize_embeddings=True)                 # warm-up
    print(json.dumps({"ready": True, "torch": torch.__version__, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        batch, count = (int(v) for v in line.split())
        start = time.perf_counter()
        for i in range(0, count, batch):
            chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
            model.encode(chunk, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True)
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
