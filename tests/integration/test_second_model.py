"""The second real model end to end: `forge serve --model gemma-3-270m` (gemma3, SentencePiece,
K-quants) as a user starts it, answered through the official openai client.

The served text must be the reference's greedy continuation (tests/data/gemma3_270m_reference.json,
made by transformers from the same file), plain and streamed; the model is named by the catalogue
name and found in FORGE_HOME without a download (FORGE_DOWNLOAD=0).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import anyio
import httpx
import openai

from forge.text.tokenizer import Tokenizer
from tests.integration.harness import HANG_GUARD_S, forge_serve, wait_healthy

REFERENCE = json.loads((Path(__file__).resolve().parent.parent / "data" / "gemma3_270m_reference.json").read_text())


async def test_gemma3_serves_the_reference_continuation(tmp_path: Path, gemma3_model_path: Path) -> None:
    [case] = [c for c in REFERENCE["greedy"] if c["prompt"] == "The capital of France is"]
    tok = Tokenizer.from_gguf(gemma3_model_path)
    gaps = case["top2_gap"]
    num_tokens = next((i for i, gap in enumerate(gaps) if gap < 1e-3), len(gaps))      # up to a near-tie
    expected = tok.decode(case["output_ids"][:num_tokens])
    serve = forge_serve(tmp_path, ["--model", "gemma-3-270m", "--kv-cache-memory", "256MiB"],
                        forge_home=gemma3_model_path.parent.parent)
    async with serve as (proc, port, log):
        with anyio.fail_after(HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, lambda: log.read_text()[-4000:], interval=0.2)
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                          timeout=HANG_GUARD_S) as client:
                models = await client.models.list()
                plain = await client.completions.create(model="gemma-3-270m", prompt=case["prompt"],
                                                        max_tokens=num_tokens, temperature=0)
                stream = await client.completions.create(model="gemma-3-270m", prompt=case["prompt"],
                                                         max_tokens=num_tokens, temperature=0, stream=True)
                streamed = "".join([chunk.choices[0].text async for chunk in stream])
                chat = await client.chat.completions.create(
                    model="gemma-3-270m", messages=[{"role": "user", "content": "Name a color."}],
                    max_completion_tokens=5, temperature=0)
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0, log.read_text()[-4000:]
    assert [m.id for m in models.data] == ["gemma-3-270m"]
    assert plain.choices[0].text == streamed == expected
    assert plain.usage is not None and plain.usage.prompt_tokens == len(case["prompt_ids"])   # <bos> included
    assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens <= 5
    [ready] = [line for line in log.read_text().splitlines() if "ready" in line and "architecture" in line]
    assert "gemma-3-270m-q4_k_m.gguf" in ready and "gemma3" in ready and "spm" in ready
    assert "downloading" not in log.read_text().lower()
