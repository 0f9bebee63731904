"""A loaded model's handle: what the gateway's routes talk to once the model is loaded (the stream
demultiplexer, the tokenizer actor's inbox, the tokenizer and template for checks at the edge, and the
read-only figures admission and routers read)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from actors.http.admission import LoadStats
from actors.http.choice_reader import ReasoningReading
from actors.ops.metrics import ModelMetrics
from actors.runtime.stream_demux import StreamDemux
from forge.api.openai.openai_prepare import PreparedChat, template_messages
from forge.engine.assembly import Serving
from forge.errors import RequestError
from forge.messages import Abort, FlushCache, Submit
from forge.sampling.sampling_params import SamplingParams, Thinking
from forge.sampling.structured import Grammars
from forge.text.chat_template import ChatTemplate
from forge.text.tokenizer import Tokenizer
from forge.text.tool_calls import Function

T = TypeVar("T")


@dataclass(slots=True)
class ModelHandle:
    """What the gateway talks to once the model is loaded. An embedding model (embeds_only) has no
    text tokenizer, chat template or grammars: the routes that need one answer 400."""
    demux: StreamDemux
    to_tokenizer: MemoryObjectSendStream[Submit | Abort | FlushCache]   # the tokenizer's inbox (or the encoder's)
    max_model_len: int
    load_stats: LoadStats
    serving: Serving                                # what is served (forge.engine.assembly)
    metrics: ModelMetrics                           # its series (the responses' latencies are observed there)
    text_tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    grammar_engine: Grammars | None = None
    vocab_size: int = 0                             # token ids an input may hold lie in [0, vocab_size)
    max_input_tokens: int | None = None             # longest embedding input in tokens (None: the engine checks)
    load: Callable[[], int] = lambda: 0             # sequences running and waiting (a router's /get_load)
    step_age: Callable[[], float] = lambda: 0.0     # seconds the engine step in flight has run (0: none)
    # The thread the routes' own template rendering and encoding run in (/tokenize, count_tokens, ...).
    edge_thread: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(1))
    reasoning_parser: str = "none"                  # the model's thinking-section format (forge.sampling.reasoning)
    thinking_close_ids: tuple[int, ...] = ()        # forge.sampling.reasoning.CLOSING_TEXT's ids: a budget's forced end

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

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """`fn()` (work proportional to a request's size: rendering a template, encoding text) in a worker
        thread, so that the event loop and every stream go on meanwhile."""
        return await anyio.to_thread.run_sync(fn, limiter=self.edge_thread)

    def chat_prompt_ids(self, entries: list[dict[str, Any]], functions: list[Function], *,
                        add_generation_prompt: bool = True, kwargs: dict[str, Any] | None = None) -> list[int]:
        """The ids a chat request's messages (forge.api.openai.openai_prepare.chat_template_messages) and
        tools run as."""
        messages, tools = template_messages(self.template.supports_tools, entries, functions)
        text = self.template.render(list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                                    kwargs=kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def thinking(self, prep: PreparedChat) -> tuple[SamplingParams, ReasoningReading | None]:
        """A chat's params with its thinking section followed by the runner (counted, and closed at its
        budget), and how its text splits into reasoning and content; unchanged, and None, for a model
        without a reasoning format. A request with an output constraint has no section: its grammar holds
        from the first token, so the text is all content."""
        if self.reasoning_parser == "none" or prep.constraint is not None:
            return prep.params, None
        if self.reasoning_parser == "harmony":      # read by channel: the text keeps the markers; no budget
            return msgspec.structs.replace(prep.params, skip_special_tokens=False), ReasoningReading(harmony=True)
        thinking = Thinking(budget=prep.thinking_budget, close_ids=self.thinking_close_ids)
        return (msgspec.structs.replace(prep.params, thinking=thinking),
                ReasoningReading(starts_inside=self.reasoning_parser == "deepseek_r1"))

    def template_kwargs(self, prep: PreparedChat) -> dict[str, Any] | None:
        """A chat's variables for the template: its chat_template_kwargs, and for harmony (gpt-oss, whose
        template writes "Reasoning: low|medium|high" into its system message) its reasoning_effort at the
        nearest of those levels, unless the kwargs name one."""
        kwargs, effort = prep.request.chat_template_kwargs, prep.request.reasoning_effort
        if self.reasoning_parser != "harmony" or effort is None or "reasoning_effort" in (kwargs or {}):
            return kwargs
        return {**(kwargs or {}), "reasoning_effort": HARMONY_EFFORTS[effort]}


# OpenAI's effort levels as harmony's three (its template says "Reasoning: ..." in the system message).
HARMONY_EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high",
                   "xhigh": "high", "max": "high"}


def only_embeds(name: str) -> RequestError:
    return RequestError(f"the model '{name}' is an embedding model: it serves only POST /v1/embeddings",
                        param="model", code="model_only_embeds")
