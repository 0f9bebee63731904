"""A mixture of experts served end to end: `forge serve --model tiny-qwen3moe.gguf` as a user starts it,
a completion and a chat completion over HTTP.

The file is tests/tiny_families.py's qwen3moe (8 experts, top 2) as llama.cpp's converter writes it;
the greedy token served after the reference input is the one transformers' logits put first
(tests/data/tiny_families_reference.json).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import anyio
import httpx
import numpy as np

from tests import tiny_families
from tests.integration.harness import HANG_GUARD_S, forge_serve, wait_healthy

REFERENCE = json.loads((Path(__file__).resolve().parent.parent / "data" / "tiny_families_reference.json").read_text())


async def test_a_mixture_of_experts_serves_completions_and_chat(tmp_path: Path) -> None:
    [case] = [c for c in REFERENCE["cases"] if c["family"] == "qwen3moe"]
    last = np.sort(np.array(case["logits"][-1]))
    assert last[-1] - last[-2] > 1e-3                   # a first choice float32 rounding cannot swap
    expected = int(np.argmax(case["logits"][-1]))
    assert expected >= len(tiny_families.SPECIAL_TOKENS)
    path = tiny_families.write_gguf("qwen3moe", tmp_path / "tiny-qwen3moe.gguf", readable_tokenizer=True)
    args = ["--model", str(path), "--kv-cache-memory", "64MiB", "--max-model-len", "128"]
    async with forge_serve(tmp_path, args, forge_home=tmp_path / "home") as (proc, port, log):
        with anyio.fail_after(HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, lambda: log.read_text()[-4000:], interval=0.2)
                completion = await http.post("/v1/completions", json={
                    "model": "tiny-qwen3moe", "prompt": case["input_ids"], "max_tokens": 1, "temperature": 0,
                    "logprobs": 1})
                chat = await http.post("/v1/chat/completions", json={
                    "model": "tiny-qwen3moe", "messages": [{"role": "user", "content": "ab ab ab"}],
                    "max_tokens": 4, "temperature": 0})
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0, log.read_text()[-4000:]
    assert completion.status_code == 200, completion.text
    tokens = completion.json()["choices"][0]["logprobs"]["tokens"]
    vocab = tiny_families._tokens(64)
    vocab[-1] = "ab"
    assert len(tokens) == 1 and tokens[0].replace("Ġ", " ") == vocab[expected].replace("Ġ", " ")
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] <= 4
    [ready] = [line for line in log.read_text().splitlines() if "ready" in line and "architecture" in line]
    assert "qwen3moe" in ready
