"""forge.text.chat_template: the real model's chat template, the ChatML fallback, and invalid messages."""

from __future__ import annotations

from typing import Any

import pytest

from forge.errors import InvalidRequest, ModelLoadError
from forge.models.hub import pull
from forge.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from forge.text.tokenizer import Tokenizer

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(pull(progress=lambda _message: None))


@pytest.fixture(scope="module")
def template(tok: Tokenizer) -> ChatTemplate:
    assert tok.bos_token_id is not None and tok.eos_token_id is not None
    return ChatTemplate(
        tok.chat_template, bos_token=tok.token_str(tok.bos_token_id), eos_token=tok.token_str(tok.eos_token_id)
    )


def test_real_template_adds_default_system_message(template: ChatTemplate) -> None:
    assert not template.is_fallback
    prompt = template.render([{"role": "user", "content": "Hi!"}])
    assert prompt == SYSTEM + "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_real_template_keeps_given_system_message(template: ChatTemplate) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ]
    assert template.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n"
    )


def test_rendered_prompt_tokenizes_with_special_ids(template: ChatTemplate, tok: Tokenizer) -> None:
    ids = tok.encode(template.render([{"role": "user", "content": "Hi"}]))
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_text_parts_are_concatenated(template: ChatTemplate) -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    as_parts = template.render([{"role": "user", "content": parts}])
    assert as_parts == template.render([{"role": "user", "content": "Hello, world"}])


def test_fallback_is_chatml() -> None:
    template = ChatTemplate(None, bos_token="", eos_token="")
    assert template.is_fallback and template.source == CHATML_TEMPLATE
    prompt = template.render([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_assistant_null_content_is_empty() -> None:
    prompt = ChatTemplate("").render([{"role": "assistant", "content": None}], add_generation_prompt=False)
    assert prompt == "<|im_start|>assistant\n<|im_end|>\n"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "must not be empty"),
        ("hello", "must be a list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content parts"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\]\.text"),
    ],
)
def test_invalid_messages(template: ChatTemplate, messages: Any, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        template.render(messages)
    assert info.value.param == "messages"


def test_raise_exception_becomes_invalid_request() -> None:
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    template = ChatTemplate(source)
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequest, match="first must be user") as info:
        template.render([{"role": "system", "content": "x"}])
    assert info.value.param == "messages"


def test_template_runtime_error_becomes_invalid_request() -> None:
    template = ChatTemplate("{{ messages[0]['content'] + 1 }}")
    with pytest.raises(InvalidRequest, match="could not apply the chat template"):
        template.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequest):
        template.render([{"role": "user", "content": "x"}])


def test_template_features() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "<é>"}, {"role": "user", "content": "skipped"}])
    assert prompt == '<s>{"role": "user", "content": "<é>"}</s>'


def test_template_is_immutable() -> None:
    template = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    with pytest.raises(InvalidRequest):
        template.render([{"role": "user", "content": "x"}])


def test_trim_blocks() -> None:
    source = "{% for m in messages %}\n  {% if true %}\n[{{ m['content'] }}]\n  {% endif %}\n{% endfor %}\n"
    assert ChatTemplate(source).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == (
        "[a]\n[b]\n"
    )


def test_template_that_does_not_compile() -> None:
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for %}")
