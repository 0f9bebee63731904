"""What the gateway's routes talk to once the model is loaded: the router, the tokeniser actor's inbox, the
tokenizer and template for checks at the edge, and the read-only figures admission and routers read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from anyio.streams.memory import MemoryObjectSendStream

from actors.admission import LoadStats
from actors.router import Router
from forge.chat import ChatTemplate
from forge.engine import Serving
from forge.errors import RequestError
from forge.messages import Abort, FlushCache, Submit
from forge.prepare import template_messages
from forge.structured import Grammars
from forge.tokenizer import Tokenizer
from forge.tools import Function


@dataclass(slots=True)
class Pipeline:
    """What the gateway talks to once the model is loaded. An embedding model (embeds_only) has no
    text tokenizer, chat template or grammars: the routes that need one answer 400."""
    router: Router
    to_tokeniser: MemoryObjectSendStream[Submit | Abort | FlushCache]   # the tokeniser's inbox (or the encoder's)
    max_model_len: int
    load_stats: LoadStats
    serving: Serving                                # what is served (forge.engine)
    text_tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    grammar_engine: Grammars | None = None
    vocab_size: int = 0                             # token ids an input may hold lie in [0, vocab_size)
    max_input_tokens: int | None = None             # longest embedding input in tokens (None: the engine checks)
    load: Callable[[], int] = lambda: 0             # sequences running and waiting (a router's /get_load)
    step_age: Callable[[], float] = lambda: 0.0     # seconds the engine step in flight has run (0: none)

    @property
    def embeds_only(self) -> bool:
        return self.text_tokenizer is None

    @property
    def tokenizer(self) -> Tokenizer:
        if self.text_tokenizer is None:
            raise only_embeds(self.serving.served_model_name)
        return self.text_tokenizer

    @property
    def template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise only_embeds(self.serving.served_model_name)
        return self.chat_template

    @property
    def grammars(self) -> Grammars:
        if self.grammar_engine is None:
            raise only_embeds(self.serving.served_model_name)
        return self.grammar_engine

    def chat_prompt_ids(self, entries: list[dict[str, Any]], functions: list[Function], *,
                        add_generation_prompt: bool = True) -> list[int]:
        """The ids a chat request's messages (forge.prepare.chat_template_messages) and tools run as."""
        messages, tools = template_messages(self.template.supports_tools, entries, functions)
        text = self.template.render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools)
        return self.tokenizer.encode(text, add_special_tokens=False)


def only_embeds(name: str) -> RequestError:
    return RequestError(f"the model '{name}' is an embedding model: it serves only POST /v1/embeddings",
                        param="model", code="model_only_embeds")
