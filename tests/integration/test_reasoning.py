"""A reasoning model end to end, through the real daemon and the official `openai` and `anthropic` clients.

The model is the default model's real weights behind its real tokenizer with two of its unused added
tokens renamed `<think>` and `</think>` (user-defined, as Qwen3's file has them: kept in the text) and a
ChatML template whose generation prompt opens the section (`deepseek_r1`, detected by `auto`), or one that
leaves it to the model and writes an empty one when `enable_thinking` is false (`qwen3`). The small model
never closes a section on its own, so a budget is what ends it: forge forces `</think>` and the model
answers after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from forge.llm import LoadedModel
from forge.models.gguf_file import read_gguf
from forge.text.chat_template import ChatTemplate
from forge.text.tokenizer import Tokenizer
from forge.text.tokenizer_models import TOKEN_TYPE_USER_DEFINED, Metadata
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, engine_config

THINK_IDS = (14, 15)          # <jupyter_output>, <jupyter_script> in the default model: never in a prompt
TURNS = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
R1_TEMPLATE = TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
QWEN3_TEMPLATE = TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n"
                          "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                          "{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def thinking_tokenizer(path: Path) -> Tokenizer:
    """The default model's tokenizer with `<think>` and `</think>` as user-defined added tokens."""
    meta = Metadata(read_gguf(path))
    tokens = list(meta.strings("tokenizer.ggml.tokens") or ())
    types = list(meta.numbers("tokenizer.ggml.token_type") or ())
    for token_id, tag in zip(THINK_IDS, ("<think>", "</think>"), strict=True):
        tokens[token_id], types[token_id] = tag, TOKEN_TYPE_USER_DEFINED
    return Tokenizer(tokens, meta.strings("tokenizer.ggml.merges") or (), token_types=types,
                     pre=meta.string("tokenizer.ggml.pre") or "default",
                     bos_token_id=meta.number("tokenizer.ggml.bos_token_id"),
                     eos_token_id=meta.number("tokenizer.ggml.eos_token_id"))


@pytest.fixture(scope="module")
def thinking_tok(default_model_path: Path) -> Tokenizer:
    return thinking_tokenizer(default_model_path)


def model_with(loaded: LoadedModel, tok: Tokenizer, template: str) -> LoadedModel:
    return dataclasses.replace(loaded, tokenizer=tok, chat_template=ChatTemplate(template, eos_token="<|im_end|>"))


@asynccontextmanager
async def serving(loaded: LoadedModel, **engine: Any) -> AsyncIterator[str]:
    config = DaemonConfig(engine=engine_config(**engine), gateway=GatewayConfig(served_model_name=SERVED_MODEL),
                          model=loaded.path, drain_timeout=5.0)
    async with running_daemon(Daemon(config, loaded)) as url:
        yield url


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_the_tags_are_single_added_tokens_kept_in_the_text(thinking_tok: Tokenizer) -> None:
    ids = thinking_tok.encode("<think>\nhi\n</think>\n\n", add_special_tokens=False)
    assert ids[0] == THINK_IDS[0] and THINK_IDS[1] in ids
    assert thinking_tok.decode(ids) == "<think>\nhi\n</think>\n\n"


async def test_a_budget_closes_the_section_and_the_answer_follows(loaded: LoadedModel, thinking_tok: Tokenizer) -> None:
    model = model_with(loaded, thinking_tok, R1_TEMPLATE)
    request: dict[str, Any] = dict(model=SERVED_MODEL, messages=QUESTION, max_completion_tokens=40, temperature=0)
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(model) as url, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                                             timeout=HANG_GUARD_S) as client:
            async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                stats = (await http.get("/stats")).json()
            plain = await client.chat.completions.create(**request, extra_body={"thinking_budget": 8})
            stream = await client.chat.completions.create(**request, extra_body={"thinking_budget": 8}, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            unbounded = await client.chat.completions.create(**request, reasoning_effort="low",
                                                             extra_body={"ignore_eos": True})
    assert stats["serving"]["reasoning_parser"] == "deepseek_r1"                     # auto, from the template
    message = plain.choices[0].message
    reasoning = extra(message, "reasoning_content")
    assert reasoning and message.content, message
    assert "<think>" not in reasoning + message.content and "</think>" not in reasoning + message.content
    assert plain.usage is not None and plain.usage.completion_tokens_details is not None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 8
    assert len(thinking_tok.encode(reasoning, add_special_tokens=False)) <= 8 + 1   # re-encoding may merge less
    # streamed: the deltas join to the message, reasoning first, and the usage counts the same
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not extra(d, "reasoning_content") for d in deltas[first_content:])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details is not None
    assert usage.completion_tokens_details.reasoning_tokens == 8
    # reasoning_effort low is 512 tokens: more than max_tokens (the end held off), so all of it is reasoning
    cut = unbounded.choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and extra(cut.message, "reasoning_content")
    assert unbounded.usage is not None and unbounded.usage.completion_tokens_details is not None
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 40


async def test_the_responses_api_writes_a_reasoning_item(loaded: LoadedModel, thinking_tok: Tokenizer) -> None:
    model = model_with(loaded, thinking_tok, R1_TEMPLATE)
    request: dict[str, Any] = dict(model=SERVED_MODEL, input=QUESTION[0]["content"], max_output_tokens=40,
                                   temperature=0, store=False)
    chat: dict[str, Any] = dict(model=SERVED_MODEL, messages=QUESTION, max_completion_tokens=40, temperature=0)
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(model) as url, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                                             timeout=HANG_GUARD_S) as client:
            plain = await client.responses.create(**request, extra_body={"thinking_budget": 8})
            async with client.responses.stream(**request, extra_body={"thinking_budget": 8}) as stream:
                events = [event async for event in stream]
                streamed = await stream.get_final_response()
            same = await client.chat.completions.create(**chat, extra_body={"thinking_budget": 8})
            effort = await client.responses.create(**request, reasoning={"effort": "minimal"},
                                                   extra_body={"ignore_eos": True})
            none = await client.responses.create(**request, reasoning={"effort": "none"})
    # the thinking section is a reasoning item before the message, as chat splits it
    thought, said = plain.output
    assert thought.type == "reasoning" and said.type == "message" and thought.status == "completed"
    assert thought.content is not None and thought.summary == []
    assert thought.content[0].text == extra(same.choices[0].message, "reasoning_content")
    assert plain.output_text == same.choices[0].message.content and "</think>" not in plain.output_text
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 8
    # streamed: the reasoning_text deltas join to the item's text, and the final response is the body's
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought.content[0].text
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    assert done == [deltas]
    def items(response: Any) -> list[dict[str, Any]]:
        return [o.model_dump(exclude={"id", "parsed"}, exclude_none=True) for o in response.output]

    assert items(streamed) == items(plain)
    # effort minimal is 128 tokens, more than max_output_tokens: all reasoning, cut by the length
    assert effort.status == "incomplete" and [o.type for o in effort.output] == ["reasoning"]
    assert effort.output[0].status == "incomplete"
    assert effort.usage is not None and effort.usage.output_tokens_details.reasoning_tokens == 40
    assert none.reasoning is not None and none.reasoning.effort == "none"
    assert none.usage is not None and none.usage.output_tokens_details.reasoning_tokens == 0
    assert all(o.type == "message" for o in none.output)


async def test_bad_budgets_are_refused_naming_the_field(loaded: LoadedModel, thinking_tok: Tokenizer) -> None:
    model = model_with(loaded, thinking_tok, R1_TEMPLATE)
    body = {"model": SERVED_MODEL, "messages": QUESTION, "max_tokens": 4}
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(model) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            negative = await http.post("/v1/chat/completions", json={**body, "thinking_budget": -1})
            effort = await http.post("/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
            responses = await http.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "extreme"}})
            messages = await http.post("/v1/messages", json={**body, "thinking": {"type": "enabled",
                                                                                  "budget_tokens": -5}})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "thinking_budget"
    assert effort.status_code == 400 and effort.json()["error"]["param"] == "reasoning_effort"
    assert responses.status_code == 400 and responses.json()["error"]["param"] == "reasoning.effort"
    assert messages.status_code == 400 and "thinking.budget_tokens" in messages.json()["error"]["message"]


async def test_the_anthropic_client_sees_thinking_blocks(loaded: LoadedModel, thinking_tok: Tokenizer) -> None:
    model = model_with(loaded, thinking_tok, R1_TEMPLATE)
    request: dict[str, Any] = dict(model=SERVED_MODEL, max_tokens=40, messages=QUESTION,
                                   thinking={"type": "enabled", "budget_tokens": 8}, extra_body={"temperature": 0})
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(model) as url, anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0,
                                                                   timeout=HANG_GUARD_S) as claude:
            plain = await claude.messages.create(**request)
            async with claude.messages.stream(**request) as stream:
                kinds = [event.type async for event in stream]
                streamed = await stream.get_final_message()
            disabled = await claude.messages.create(**{**request, "thinking": {"type": "disabled"}})
    thinking, text = plain.content
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature == ""
    assert text.type == "text" and text.text
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert "thinking" in kinds and "text" in kinds                    # thinking_delta and text_delta events
    # disabled: a template without enable_thinking closes the section at once (budget 0): no thinking block
    # (this small model, given the closed section, may end its turn right there)
    assert all(b.type == "text" for b in disabled.content) and disabled.usage.output_tokens >= 3


async def test_enable_thinking_reaches_the_template(loaded: LoadedModel, thinking_tok: Tokenizer) -> None:
    model = model_with(loaded, thinking_tok, QWEN3_TEMPLATE)
    body = {"model": SERVED_MODEL, "messages": QUESTION, "max_tokens": 12, "min_tokens": 6, "temperature": 0}
    with anyio.fail_after(HANG_GUARD_S):
        async with serving(model) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            stats = (await http.get("/stats")).json()
            on = (await http.post("/v1/chat/completions", json=body)).json()
            off = (await http.post("/v1/chat/completions",
                                   json={**body, "chat_template_kwargs": {"enable_thinking": False}})).json()
    assert stats["serving"]["reasoning_parser"] == "qwen3"
    # the empty section the template writes: <think>, "\n\n", </think>, "\n\n"
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + 4
    for reply in (on, off):                             # the model did not open a section: all content
        message = reply["choices"][0]["message"]
        assert "reasoning_content" not in message and message["content"]
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
