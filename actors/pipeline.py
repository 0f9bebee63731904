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
from forge.messages import Abort, FlushCache, Submit
from forge.prepare import template_messages
from forge.structured import Grammars
from forge.tokenizer import Tokenizer
from forge.tools import Function


@dataclass(slots=True)
class Pipeline:
    """What the gateway talks to once the model is loaded."""
    router: Router
    to_tokeniser: MemoryObjectSendStream[Submit | Abort | FlushCache]
    tokenizer: Tokenizer
    template: ChatTemplate
    max_model_len: int
    load_stats: LoadStats
    grammars: Grammars
    serving: Serving                                # what is served (forge.engine)
    vocab_size: int = 0                             # token ids an input may hold lie in [0, vocab_size)
    max_input_tokens: int | None = None             # longest embedding input in tokens (None: the engine checks)
    load: Callable[[], int] = lambda: 0             # sequences running and waiting (a router's /get_load)
    step_age: Callable[[], float] = lambda: 0.0     # seconds the engine step in flight has run (0: none)

    def chat_prompt_ids(self, entries: list[dict[str, Any]], functions: list[Function], *,
                        add_generation_prompt: bool = True) -> list[int]:
        """The ids a chat request's messages (forge.prepare.chat_template_messages) and tools run as."""
        messages, tools = template_messages(self.template.supports_tools, entries, functions)
        text = self.template.render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools)
        return self.tokenizer.encode(text, add_special_tokens=False)
