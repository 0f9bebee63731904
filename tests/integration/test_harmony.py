"""A harmony (gpt-oss) reply end to end, through the real daemon and the official `openai` client.

The model is the tiny gpt-oss of tests/tiny_families.py behind a vocabulary of harmony's control tokens
and a harmony-shaped template (so `auto` picks the harmony reader); its logits are overridden to write a
scripted reply, since random weights speak no harmony: an analysis message, then a final answer or a call
to a function. The chat API answers with the analysis as reasoning_content, the final message as content
and the call as a tool call, streamed and not; the Responses API with a reasoning item, then the message
or the function call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import httpx
import numpy as np
import openai
import pytest

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.models.forward_batch import ForwardBatch
from forge.models.llama import LlamaModel
from forge.models.llama.kv_cache import KVCache
from forge.models.loading import LoadedModel
from forge.text.chat_template import ChatTemplate
from forge.text.tokenizer import Tokenizer
from tests import tiny_families
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, engine_config

MARKERS = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>"]
WORDS = ["assistant", "analysis", "final", "commentary", "Ġto=functions.add", "json", '{"a":', "Ġ2}", "Think", "ing",
         "Four", "."]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "?"]
TOKENS = MARKERS + WORDS + LETTERS
TOKENS += [f"<filler{i}>" for i in range(tiny_families.SPECS["gpt-oss"].vocab - len(TOKENS))]
ID = {t: i for i, t in enumerate(TOKENS)}
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
ANALYSIS = ["<|channel|>", "analysis", "<|message|>", "Think", "ing", "<|end|>", "<|start|>", "assistant"]
ANSWER = [*ANALYSIS, "<|channel|>", "final", "<|message|>", "Four", ".", "<|return|>"]
CALL = [*ANALYSIS, "<|channel|>", "commentary", "Ġto=functions.add", "<|constrain|>", "json", "<|message|>", '{"a":',
        "Ġ2}", "<|call|>"]
QUESTION = [{"role": "user", "content": "what is two plus two?"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
                                                                     "properties": {"a": {"type": "integer"}}}}}


class Scripted(LlamaModel):
    """The tiny model, its sampled rows' logits replaced so that greedy sampling writes `script`: the step
    of a row is counted from the end of its sequence's prompt (the last prefill chunk seen: several rows,
    only the last sampled, where a row with its guesses has each sampled; one request at a time, no prefix
    caching)."""

    script: list[int] = []
    prompt_len = 0

    def forward(self, batch: ForwardBatch, kv: KVCache) -> np.ndarray:
        logits = super().forward(batch, kv)
        starts = batch.query_start
        seqs = np.searchsorted(starts, batch.sample_indices, side="right") - 1       # each sampled row's sequence
        for row, (i, seq) in enumerate(zip(batch.sample_indices.tolist(), seqs.tolist(), strict=True)):
            position = int(batch.positions[i])
            if starts[seq + 1] - starts[seq] > 1 and np.count_nonzero(seqs == seq) == 1:
                self.prompt_len = position + 1
            step = position + 1 - self.prompt_len
            if 0 <= step < len(self.script):
                logits[row] = -1e4
                logits[row, self.script[step]] = 1e4
        return logits


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tiny_families.write_gguf("gpt-oss", tmp_path_factory.mktemp("gpt-oss") / "tiny.gguf",
                                    readable_tokenizer=True)
    loaded = LoadedModel.load(path, kernels="numpy", progress=lambda message: None)
    model = Scripted(loaded.model.config, loaded.model.weights)
    tok = Tokenizer(TOKENS, [], token_types=[3] * len(MARKERS) + [1] * (len(TOKENS) - len(MARKERS)),
                    eos_token_id=ID["<|return|>"])
    return dataclasses.replace(loaded, model=model, tokenizer=tok, chat_template=ChatTemplate(TEMPLATE))


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


async def test_analysis_is_reasoning_final_is_content_and_a_call_is_a_tool_call(harmony_model: LoadedModel) -> None:
    model = harmony_model.model
    assert isinstance(model, Scripted)
    config = DaemonConfig(engine=engine_config(max_model_len=512, enable_prefix_caching=False),
                          gateway=GatewayConfig(served_model_name=SERVED_MODEL), model=harmony_model.path,
                          drain_timeout=5.0)
    request: dict[str, Any] = dict(model=SERVED_MODEL, messages=QUESTION, max_completion_tokens=30, temperature=0)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(Daemon(config, harmony_model)) as url, openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S) as client:
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                stats = (await http.get("/stats")).json()
            model.script = [ID[t] for t in ANSWER]
            answer = await client.chat.completions.create(**request)
            stream = await client.chat.completions.create(**request, stream=True)
            chunks = [chunk async for chunk in stream]
            response = await client.responses.create(model=SERVED_MODEL, input=QUESTION[0]["content"],
                                                     max_output_tokens=30, temperature=0, store=False)
            model.script = [ID[t] for t in CALL]
            call = await client.chat.completions.create(**request, tools=[ADD])
            called = await client.responses.create(model=SERVED_MODEL, input=QUESTION[0]["content"],
                                                   max_output_tokens=30, temperature=0, store=False,
                                                   tools=[{"type": "function", **ADD["function"]}])
    assert stats["serving"]["reasoning_parser"] == "harmony"                         # auto, from the template
    choice = answer.choices[0]
    assert (extra(choice.message, "reasoning_content"), choice.message.content) == ("Thinking", "Four.")
    assert choice.finish_reason == "stop"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == "Thinking"
    assert "".join(d.content or "" for d in deltas) == "Four."
    choice = call.choices[0]
    assert extra(choice.message, "reasoning_content") == "Thinking" and not choice.message.content
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    assert [(t.function.name, t.function.arguments) for t in choice.message.tool_calls] == [("add", '{"a": 2}')]
    # the Responses API: a reasoning item, then the message or the function call
    thought, said = response.output
    assert thought.type == "reasoning" and thought.content is not None and thought.content[0].text == "Thinking"
    assert said.type == "message" and response.output_text == "Four."
    thought, fn = called.output
    assert thought.type == "reasoning" and fn.type == "function_call"
    assert (fn.name, fn.arguments) == ("add", '{"a": 2}')
