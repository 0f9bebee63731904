"""Reasoning models: the thinking section read out of generated text, whole or in any pieces; the format
detected from a chat template; and the runner's follower that counts a section's tokens and closes it at
its budget, on the real default model (its tokenizer spells the tags in several tokens)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from forge.config import EngineConfig
from forge.engine.assembly import reasoning_format
from forge.llm import LLM, LoadedModel
from forge.sampling.reasoning import (
    CLOSING_TEXT,
    ReasoningParts,
    ReasoningReader,
    SectionFollower,
    detect_format,
    split_reasoning,
)
from forge.sampling.sampling_params import SamplingParams, Thinking
from forge.text.chat_template import ChatTemplate


def test_a_qwen3_output_opens_its_section_and_an_r1_output_starts_inside_it() -> None:
    text = "<think>\nLet me see: 2 + 2.\n\nThat is 4.\n</think>\n\nIt is 4."
    assert split_reasoning(text, starts_inside=False) == split_reasoning(text, starts_inside=True)
    got = split_reasoning(text, starts_inside=False)
    assert (got.reasoning, got.content) == ("Let me see: 2 + 2.\n\nThat is 4.", "It is 4.")
    # deepseek_r1: the prompt ended in '<think>\n', so the text begins inside the section
    r1 = split_reasoning("Hmm, 4.\n</think>\n\nFour.", starts_inside=True)
    assert (r1.reasoning, r1.content) == ("Hmm, 4.", "Four.")
    # the same text read as qwen3 has no section: it is all content, tags and all
    assert split_reasoning("Hmm, 4.\n</think>\n\nFour.", starts_inside=False).reasoning is None


def test_text_without_tags_and_sections_cut_short() -> None:
    plain = split_reasoning("  Just an answer. <think> stays </think> here", starts_inside=False)
    assert (plain.reasoning, plain.content) == (None, "Just an answer. <think> stays </think> here")
    # r1 never closed (max_tokens): all reasoning, no content; a half-written tag is dropped
    cut = split_reasoning("Still thinking </thi", starts_inside=True)
    assert (cut.reasoning, cut.content) == ("Still thinking", "")
    empty = split_reasoning("<think>\n\n</think>\n\nHi.", starts_inside=False)   # enable_thinking false
    assert (empty.reasoning, empty.content) == (None, "Hi.")
    assert split_reasoning("", starts_inside=True) == split_reasoning("", starts_inside=False)
    assert split_reasoning("<thi", starts_inside=False).content == "<thi"     # not a tag after all


def test_a_partial_closing_tag_is_held_back_until_it_is_certain() -> None:
    reader = ReasoningReader(starts_inside=True)
    assert reader.push("a step </thi") == ReasoningParts("a step")
    assert reader.in_reasoning
    assert reader.push("nk>\n\nAns") == ReasoningParts("", "Ans")
    assert not reader.in_reasoning
    reader = ReasoningReader(starts_inside=True)
    assert reader.push("x </thi") == ReasoningParts("x")
    assert reader.push("ck") == ReasoningParts(" </thick")                # not the tag: reasoning after all
    reader = ReasoningReader(starts_inside=False)
    assert reader.push("\n<thi") == ReasoningParts()                      # may yet open a section
    assert reader.push("nk>a") == ReasoningParts("a")


pieces = st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "think", ">", "\n", "\n\n", "  ",
                          "Reason.", " more", "Answer", "<", "/", "x"])


@settings(max_examples=400, deadline=None)
@given(st.lists(pieces, max_size=10), st.booleans(), st.data())
def test_reading_in_pieces_gives_what_reading_whole_gives(parts: list[str], inside: bool,
                                                          data: st.DataObject) -> None:
    text = "".join(parts)
    whole = split_reasoning(text, starts_inside=inside)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    reader, got, start = ReasoningReader(starts_inside=inside), [], 0
    for cut in [*cuts, len(text)]:
        got.append(reader.push(text[start:cut]))
        start = cut
    got.append(reader.finish())
    reasoning = "".join(p.reasoning for p in got)
    assert (reasoning or None, "".join(p.content for p in got)) == (whole.reasoning, whole.content)
    for p in got:                                  # a tag never leaks into what is sent
        assert "</think>" not in p.reasoning


def test_every_split_point_of_a_text_gives_the_same_parts() -> None:
    text = "<think>\nFirst, the tags: </think\n is not one.\n</think>\n\nThe answer </think> stays."
    whole = split_reasoning(text, starts_inside=False)
    assert whole.reasoning == "First, the tags: </think\n is not one." and whole.content == "The answer </think> stays."
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            reader = ReasoningReader(starts_inside=False)
            got = [reader.push(text[:i]), reader.push(text[i:j]), reader.push(text[j:]), reader.finish()]
            assert "".join(p.reasoning for p in got) == whole.reasoning
            assert "".join(p.content for p in got) == whole.content


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
              "{% endif %}{# reasoning_content goes in <think> #}")
R1_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
           "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")


def test_auto_detects_the_format_from_the_template() -> None:
    assert reasoning_format("auto", ChatTemplate(QWEN3_LIKE)) == "qwen3"
    assert reasoning_format("auto", ChatTemplate(R1_LIKE)) == "deepseek_r1"
    assert reasoning_format("auto", ChatTemplate(None)) == "none"
    assert reasoning_format("qwen3", ChatTemplate(None)) == "qwen3"           # a named format stands
    assert detect_format("no tags here", "<think>\n") == "none"
    # enable_thinking passes through to the template, never over forge's own variables
    rendered = ChatTemplate(QWEN3_LIKE).render([{"role": "user", "content": "Hi"}],
                                               kwargs={"enable_thinking": False, "messages": "ignored"})
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "Hi" in rendered


def test_the_follower_counts_section_tokens_and_forces_the_close() -> None:
    vocab = [b"<think>", b"</think>", b"\n", b"a", b"</", b"think>", b"\n\n", b"<", b"think", b">"]
    follower = SectionFollower(vocab)
    thinking = Thinking(budget=2, close_ids=(2, 1, 6))
    inside = follower.start([7, 8, 9, 2])                     # the prompt spelled '<think>\n' in pieces
    assert inside.inside
    assert not follower.start([0, 3, 1, 2]).inside            # a closed section in the prompt
    s, counted = inside, []
    for _ in range(2):
        assert follower.forced(s, thinking) is None
        s, c = follower.advance(s, 3, thinking)
        counted.append(c)
    assert counted == [True, True] and s.num_reasoning == 2
    forced = []
    while (token := follower.forced(s, thinking)) is not None:
        forced.append(token)
        s, c = follower.advance(s, token, thinking)
        assert not c                                          # the close is not reasoning
    assert forced == [2, 1, 6] and not s.inside
    assert follower.forced(s, thinking) is None               # then the model answers
    # a model that closes the section itself (in two tokens) leaves it without forcing
    s, _ = follower.advance(inside, 4, thinking)
    s, closed = follower.advance(s, 5, thinking)
    assert not s.inside and not closed and follower.forced(s, thinking) is None


def test_the_runner_closes_a_section_at_its_budget(default_model_path: Path) -> None:
    """On the real model, greedy and sampled, batched, with and without speculation (the prompt repeats
    itself, so n-gram guesses run): a prompt that ends inside a section thinks `budget` tokens, then the
    closing text follows token for token, then the model answers; greedy output is the same either way."""
    loaded = LoadedModel.load(default_model_path, progress=lambda message: None)
    tok = loaded.tokenizer
    close = tuple(tok.encode(CLOSING_TEXT, add_special_tokens=False))
    assert len(close) > 1                                     # this tokenizer spells the tag in pieces
    budgets = [0, 3, 8, 8]
    params = [SamplingParams(max_tokens=30, min_tokens=16, temperature=t, seed=i,
                             thinking=Thinking(budget=b, close_ids=close))
              for i, (b, t) in enumerate(zip(budgets, (0.0, 0.0, 0.0, 0.8), strict=True))]
    greedy = []
    for speculative in ("off", "ngram"):
        llm = LLM.from_loaded(loaded, EngineConfig(kv_cache_dtype="float32", speculative=speculative))
        prompt = llm.chat_prompt([{"role": "user", "content": "What is 2 + 2? Repeat: 2 + 2, 2 + 2, 2 + 2."}])
        outs = llm.generate([prompt + "<think>\n"] * len(params), params)
        for out, budget in zip(outs, budgets, strict=True):
            assert tuple(out.token_ids[budget:budget + len(close)]) == close, (budget, out.text)
            got = split_reasoning(out.text, starts_inside=True)
            assert got.content, out.text                      # it went on to answer
            assert "</think>" not in (got.reasoning or "")
        greedy.append([out.token_ids for out in outs[:3]])
        if speculative == "ngram":
            assert llm.engine.core.spec.num_accepted_tokens > 0
    assert greedy[0] == greedy[1]
