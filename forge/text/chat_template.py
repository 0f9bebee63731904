"""Chat messages -> prompt text, through the model's own chat template (Jinja, sandboxed).

Owns message validation and template rendering. A model file without a template gets ChatML
(`CHATML_TEMPLATE`). Rendering is pure: no I/O, and the sandbox keeps templates from reaching Python.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.sandbox

from forge.errors import InvalidRequest, ModelLoadError

# Used when the model file carries no tokenizer.chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateRaised(Exception):
    """Raised by a template's own `raise_exception(...)` call."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Templates expect plain JSON; jinja2's own filter HTML-escapes '<', '>', '&' and "'".
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. `source=None` or "" means ChatML.

    Invariant: `render` either returns the prompt text or raises InvalidRequest(param="messages");
    a template that does not compile raises ModelLoadError at construction.
    """

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML_TEMPLATE
        self.is_fallback = not source
        # A template that reads `tools` renders them and tool turns itself; others get forge's format
        # (forge.text.tool_calls.messages_with_tools).
        self.supports_tools = "tools" in self.source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for `messages` (each a dict with "role" and "content"); `tools` (OpenAI tool
        objects) reach templates that read them; `kwargs` (a request's chat_template_kwargs, such as
        enable_thinking) are more variables for the template, never overriding the ones forge sets."""
        normalized = normalize_messages(messages)
        extra = {"tools": list(tools)} if tools else {}
        own = {"messages", "add_generation_prompt", "bos_token", "eos_token", *extra}
        variables = {k: v for k, v in (kwargs or {}).items() if k not in own}
        try:
            return self._template.render(
                **variables,
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateRaised as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except Exception as exc:
            # The template is data from the model file; whatever it trips over while rendering
            # these messages fails this request only, as a client error with the reason.
            raise InvalidRequest(
                f"could not apply the chat template to the messages: {type(exc).__name__}: {exc}", param="messages"
            ) from exc


    def generation_prompt(self) -> str:
        """What the template adds for the assistant's turn (a one-message conversation rendered with and
        without add_generation_prompt, the common start cut off): where generated text begins, which a
        reasoning format is detected from. "" for a template that cannot render it."""
        probe = [{"role": "user", "content": "Hi"}]
        try:
            with_prompt = self.render(probe, add_generation_prompt=True)
            without = self.render(probe, add_generation_prompt=False)
        except InvalidRequest:
            return ""
        return with_prompt[len(without):] if with_prompt.startswith(without) else with_prompt


def normalize_messages(messages: object) -> list[dict[str, Any]]:
    """Validate chat messages (client JSON: any object) and flatten list-of-parts content into one string.

    Each message needs a non-empty string "role" and a "content" that is a string or a list of
    {"type": "text", "text": ...} parts (concatenated without separator). An assistant message may
    have null content (read as ""). Other keys are passed to the template unchanged.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequest("messages must be a list of message objects", param="messages")
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    return [_normalize_message(i, message) for i, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidRequest(f"{where} must be an object with 'role' and 'content'", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequest(f"{where}.role must be a non-empty string", param="messages")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise InvalidRequest(f"{where}.content must be a string or a list of text parts", param="messages")
    return {**message, "role": role, "content": content}


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        raise InvalidRequest(f"{where}: only text content parts are supported (got {kind!r})", param="messages")
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{where}.text must be a string", param="messages")
    return text
