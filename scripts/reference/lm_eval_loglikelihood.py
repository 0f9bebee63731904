"""lm-evaluation-harness's loglikelihood against forge, beside the same harness on transformers in float32.

Runs one small multiple-choice task kept here (QUESTIONS, written to a temporary directory as a local json
task, so nothing is downloaded) twice through lm-evaluation-harness: once as `local-completions` against a
forge daemon (echo with logprobs: every choice's continuation scored from the prompt's logprobs), once as
`hf` on the default model loaded by transformers from the same GGUF file (dequantized to float32). Both send
the same token ids (lm-eval tokenizes with the GGUF's tokenizer, given the model's real pre-tokenizer as
make_reference.py does). Prints each document's loglikelihoods side by side, the largest difference and both
accuracies; exits 1 if a loglikelihood differs by more than --tolerance or a choice picked differs.

Not run by CI (it needs torch, transformers and lm-eval: the reference venv, plus `pip install lm-eval`):

    "$(scripts/reference/refvenv.sh)" -m pip install "lm-eval[api]==0.4.13"
    "$(scripts/reference/refvenv.sh)" scripts/reference/lm_eval_loglikelihood.py [--url http://127.0.0.1:8080]

Without --url it starts forge itself from this checkout, with --forge-python (default: .venv/bin/python),
on a free port, and stops it at the end. A few minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from forge.models.hub import forge_home  # noqa: E402  (the standard library alone: it runs in the reference venv)

DEFAULT_MODEL = forge_home() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED = "SmolLM2-135M-Instruct"
TASK = "forge_local_mc"

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("What is the capital of Japan?", ["Seoul", "Tokyo", "Beijing", "Bangkok"], 1),
    ("What is the capital of Italy?", ["Milan", "Naples", "Rome", "Venice"], 2),
    ("What is the capital of Spain?", ["Lisbon", "Barcelona", "Seville", "Madrid"], 3),
    ("What colour is the sky on a clear day?", ["blue", "green", "red", "purple"], 0),
    ("What colour is grass?", ["orange", "green", "white", "black"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("How many days are there in a week?", ["five", "ten", "twelve", "seven"], 3),
    ("Which animal barks?", ["a dog", "a cat", "a fish", "a bird"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "bread"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("Which is the largest ocean?", ["the Pacific", "the Atlantic", "the Indian", "the Arctic"], 0),
    ("What is two plus two?", ["three", "four", "five", "six"], 1),
    ("Which season comes after winter?", ["autumn", "summer", "spring", "winter"], 2),
    ("What do you call a baby cat?", ["a puppy", "a calf", "a foal", "a kitten"], 3),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the GGUF file (both sides)")
    parser.add_argument("--url", default=None, help="a forge already serving the model (else one is started)")
    parser.add_argument("--forge-python", type=Path, default=ROOT / ".venv" / "bin" / "python")
    parser.add_argument("--kv-cache-dtype", default="float32", help="the started forge's K/V cache")
    parser.add_argument("--tolerance", type=float, default=0.02, help="most a loglikelihood may differ")
    return parser.parse_args()


def task_config(data_dir: Path) -> dict[str, Any]:
    path = data_dir / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    return {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
            "test_split": "test", "output_type": "multiple_choice",
            "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]}


def gguf_tokenizer(model: Path) -> Any:
    """The GGUF's tokenizer with the model's real pre-tokenizer (digits split off, as make_reference.py)."""
    tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return tok


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_forge(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    url = f"http://127.0.0.1:{free_port()}"
    command = [str(args.forge_python), "-c", "import sys; from actors.daemon_cli import main; sys.exit(main())",
               "serve", "--addr", url.removeprefix("http://"), "--model", str(args.model),
               "--served-model-name", SERVED, "--kv-cache-dtype", args.kv_cache_dtype, "--max-model-len", "2048",
               "--kv-cache-memory", "256MiB"]
    log = (Path(tempfile.gettempdir()) / "lm_eval_forge.log").open("wb")
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"forge exited with {proc.returncode} (its log: {log.name}): {' '.join(command)}")
        time.sleep(1)
    proc.terminate()
    sys.exit("forge did not become healthy in 300 s")


def loglikelihoods(results: dict[str, Any]) -> list[list[float]]:
    """Per document (in order), each choice's loglikelihood."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    proc = None
    url = args.url
    if url is None:
        proc, url = start_forge(args)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            task = task_config(Path(tmp))
            tok = gguf_tokenizer(args.model)
            tok.save_pretrained(Path(tmp) / "tokenizer")
            started = time.monotonic()
            served = simple_evaluate(model="local-completions", tasks=[task], model_args={
                "model": SERVED, "base_url": url.rstrip("/") + "/v1/completions", "tokenizer_backend": "huggingface",
                "tokenizer": str(Path(tmp) / "tokenizer"), "tokenized_requests": True, "max_retries": 1})
            forge_s = time.monotonic() - started
            model = AutoModelForCausalLM.from_pretrained(str(args.model.parent), gguf_file=args.model.name,
                                                         dtype=torch.float32, attn_implementation="eager")
            started = time.monotonic()
            reference = simple_evaluate(model=HFLM(pretrained=model.eval(), tokenizer=tok, batch_size=1),
                                        tasks=[task])
            hf_s = time.monotonic() - started
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    assert served is not None and reference is not None
    ours, theirs = loglikelihoods(served), loglikelihoods(reference)
    worst, disagree = 0.0, 0
    print(f"{'question':42s} {'forge':>34s}   {'transformers fp32':>34s}")
    for (question, _, _), a, b in zip(QUESTIONS, ours, theirs, strict=True):
        worst = max(worst, *(abs(x - y) for x, y in zip(a, b, strict=True)))
        disagree += a.index(max(a)) != b.index(max(b))
        print(f"{question[:42]:42s} {' '.join(f'{x:8.3f}' for x in a)}   {' '.join(f'{x:8.3f}' for x in b)}")
    acc = (served["results"][TASK]["acc,none"], reference["results"][TASK]["acc,none"])
    print(f"accuracy: forge {acc[0]:.3f}, transformers {acc[1]:.3f}; largest loglikelihood difference {worst:.2e}; "
          f"choices picked differently: {disagree}; forge {forge_s:.1f} s, transformers {hf_s:.1f} s")
    if worst > args.tolerance or disagree:
        sys.exit(1)


if __name__ == "__main__":
    main()
