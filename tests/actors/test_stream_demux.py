"""The router: per-request events to the response that reads them, never blocking the producer."""

from __future__ import annotations

import anyio

from actors.runtime.stream_demux import SLOW_READER, StreamDemux
from forge.messages import Accepted, Rejected, TextDelta, TokenCounts


def delta(rid: str, text: str, finish: bool = False) -> TextDelta:
    return TextDelta(request_id=rid, text=text, num_tokens=1, finish_reason="length" if finish else None,
                     counts=TokenCounts(prompt=3, completion=len(text)))


async def test_an_unread_choice_coalesces_into_one_delta_and_delivery_never_waits() -> None:
    demux = StreamDemux()
    group = demux.open(["a", "b"])
    for i in range(1000):                                  # a stalled reader: nothing is read meanwhile
        demux.deliver(delta("a", "x", finish=i == 999))   # deliver() is synchronous: it cannot block
    demux.deliver(delta("b", "y"))
    with anyio.fail_after(1):
        got = dict(await group.next_deltas())
    assert got[0].text == "x" * 1000 and got[0].num_tokens == 1000 and got[0].finish_reason == "length"
    assert got[1].text == "y" and group.unfinished == {1}


async def test_a_coalesced_delta_keeps_the_stop_string_that_ended_the_choice() -> None:
    demux = StreamDemux()
    group = demux.open(["a"])
    demux.deliver(delta("a", "x"))
    demux.deliver(TextDelta(request_id="a", text="", num_tokens=1, finish_reason="stop", stop_string="END"))
    with anyio.fail_after(1):
        [(_, got)] = await group.next_deltas()
    assert got.text == "x" and got.finish_reason == "stop" and got.stop_string == "END"


async def test_the_first_rejection_answers_for_the_whole_response() -> None:
    demux = StreamDemux()
    group = demux.open(["a", "b", "c"])
    demux.deliver(Accepted(request_id="a", num_prompt_tokens=2))
    demux.deliver(Rejected(request_id="b", status=400, message="no"))
    with anyio.fail_after(1):
        statuses = await group.wait_statuses()             # c has no verdict yet: no need to wait
    assert [type(s) for s in statuses] == [Accepted, Rejected]


async def test_events_for_a_closed_response_are_dropped_and_nothing_is_kept() -> None:
    demux = StreamDemux()
    group = demux.open(["a"])
    demux.close(group)
    demux.deliver(delta("a", "late"))
    demux.deliver(delta("never-opened", "stray"))
    assert len(demux) == 0


async def test_past_its_bound_a_response_drops_what_waits_and_ends_its_choices_once() -> None:
    demux = StreamDemux()
    group = demux.open(["a", "b", "c"])
    cut_off: list[int] = []
    group.bound(10, cut_off.append)
    demux.deliver(delta("c", "z", finish=True))            # c ended in the engine, unread
    for _ in range(6):
        demux.deliver(delta("a", "x"))
        demux.deliver(delta("b", "y"))
    assert cut_off == [11]                                   # at the 11th token waiting, once
    demux.deliver(delta("a", "late"))                       # in flight before the abort landed: ignored
    with anyio.fail_after(1):
        got = dict(await group.next_deltas())
    assert all(d.error == SLOW_READER and d.text == "" and d.num_tokens == 0 for d in got.values())
    assert sorted(got) == [0, 1, 2] and group.unfinished == set() and group.num_unsent_tokens == 0
    assert got[0].counts == TokenCounts(prompt=3, completion=1)    # the counts of what was dropped
    assert cut_off == [11]


async def test_a_reader_that_keeps_up_is_never_cut_off() -> None:
    demux = StreamDemux()
    group = demux.open(["a"])

    def never(num_unsent: int) -> None:
        raise AssertionError(f"cut off with {num_unsent} tokens waiting")

    group.bound(10, never)
    with anyio.fail_after(1):
        for _ in range(100):
            for _ in range(10):
                demux.deliver(delta("a", "x"))
            [(_, got)] = await group.next_deltas()
            assert got.num_tokens == 10 and group.num_unsent_tokens == 0
