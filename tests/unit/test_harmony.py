"""gpt-oss's harmony replies read by channel (forge.text.harmony): analysis as reasoning, final as content,
calls to functions as forge's own tool calls, which forge.text.tool_calls then takes out; `auto` picks the
format from a template that writes channels, and a chat under it keeps the markers in its text."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from forge.sampling.reasoning import detect_format
from forge.text.chat_template import ChatTemplate
from forge.text.harmony import HarmonyReader, is_harmony
from forge.text.tokenizer import Tokenizer
from forge.text.tool_reader import read_message

ANALYSIS = "<|channel|>analysis<|message|>The user asks for 2 + 2. Easy.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Oslo", "unit": "C"}<|call|>')
# A harmony template's shape: the real one (OpenAI's, in gpt-oss files) adds a system message, the developer's
# instructions and the tools' TypeScript, and renders past tool calls and results.
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def read(text: str, cuts: list[int] | None = None) -> tuple[str, str]:
    """(reasoning, content) of text fed whole, or in the pieces cut at `cuts`."""
    reader = HarmonyReader()
    bounds = [0, *sorted(set(cuts or [])), len(text)]
    parts = [reader.push(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [reader.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.content for p in parts)


def test_analysis_is_reasoning_and_final_is_content() -> None:
    assert read(ANALYSIS + FINAL) == ("The user asks for 2 + 2. Easy.", "2 + 2 = 4.")
    assert read(FINAL) == ("", "2 + 2 = 4.")
    assert read(ANALYSIS) == ("The user asks for 2 + 2. Easy.", "")


def test_a_call_to_a_function_becomes_forges_tool_call() -> None:
    reasoning, content = read(ANALYSIS + CALL)
    assert reasoning == "The user asks for 2 + 2. Easy."
    message = read_message(content)
    assert message.content is None and [(c.name, json.loads(c.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})]


def test_the_recipient_may_stand_before_the_channel_and_a_preamble_is_content() -> None:
    call = '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>'
    message = read_message(read(call)[1])
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("lookup", '{"q": "x"}')]
    preamble = "<|channel|>commentary<|message|>Let me look that up.<|end|>"
    assert read(preamble) == ("", "Let me look that up.")
    browser = '<|channel|>analysis to=browser.search<|message|>{"query": "oslo"}<|call|>'   # not a tool forge runs
    assert read(browser) == ('{"query": "oslo"}', "")


def test_text_without_harmony_is_the_answer_and_a_reply_cut_short_keeps_its_body() -> None:
    assert read("just text") == ("", "just text")
    assert read("<|channel|>final<|message|>cut sh") == ("", "cut sh")
    assert read("<|channel|>analysis<|message|>thinking and then<|end|><|start|>assistant<|chan") == (
        "thinking and then", "")
    message = read_message(read('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1')[1])
    assert [(c.name, c.arguments) for c in message.tool_calls] == [("f", '{"a": 1')]   # the length limit's cut


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(1, len(ANALYSIS + CALL + FINAL) - 1), max_size=12))
def test_reading_in_pieces_gives_what_reading_whole_gives(cuts: list[int]) -> None:
    text = ANALYSIS + CALL + FINAL
    assert read(text, cuts) == read(text)


def test_auto_picks_harmony_from_a_template_with_channels() -> None:
    template = ChatTemplate(TEMPLATE)
    assert is_harmony(template.source)
    assert detect_format(template.source, template.generation_prompt()) == "harmony"
    assert template.render([{"role": "user", "content": "2 + 2?"}]) == (
        "<|start|>user<|message|>2 + 2?<|end|><|start|>assistant")
    assert detect_format("{{ messages }}<think>", "") == "qwen3"                  # the others as before


def test_the_markers_stay_in_the_text_when_special_tokens_are_kept() -> None:
    """The reader needs the markers: harmony's are control tokens, dropped by default, kept on request (a
    harmony chat asks, actors/runtime/model_handle.py)."""
    tokens = ["a", "b", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
    tok = Tokenizer(tokens, [], token_types=[1, 1, 3, 3, 3, 3, 3], eos_token_id=6)
    ids = [3, 0, 4, 1, 5]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<|channel|>a<|message|>b<|end|>"
    assert read(tok.decode(ids, skip_special_tokens=False)) == ("b", "")


def test_a_chats_reasoning_effort_reaches_a_harmony_template_as_its_level() -> None:
    """gpt-oss's template writes "Reasoning: low|medium|high": a request's reasoning_effort becomes the
    nearest level, unless its chat_template_kwargs name one; other formats' kwargs are the request's."""
    from types import SimpleNamespace

    from actors.runtime.model_handle import ModelHandle

    def kwargs(parser: str, effort: str | None, given: dict[str, str] | None = None) -> object:
        prep = SimpleNamespace(request=SimpleNamespace(reasoning_effort=effort, chat_template_kwargs=given))
        return ModelHandle.template_kwargs(SimpleNamespace(reasoning_parser=parser), prep)  # type: ignore[arg-type]

    assert kwargs("harmony", "xhigh") == {"reasoning_effort": "high"}
    assert kwargs("harmony", "minimal", {"x": "1"}) == {"x": "1", "reasoning_effort": "low"}
    assert kwargs("harmony", "high", {"reasoning_effort": "low"}) == {"reasoning_effort": "low"}
    assert kwargs("harmony", None) is None
    assert kwargs("qwen3", "high", {"enable_thinking": "x"}) == {"enable_thinking": "x"}
