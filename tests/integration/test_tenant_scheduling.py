"""Priority and fair turns through the real daemon, read from the order of first tokens and from the
preemption counters (never from timings): with two sequences running at most, a light tenant's one request
takes a slot from a heavy tenant that holds both (before the heavy tenant's queue, long before its running
streams end), two tenants of equal load share the slots without taking them back and forth, nothing is
preempted without a tenant file, and a more urgent request takes the next slot (a full batch gives one up to it)."""

from __future__ import annotations

from typing import Any

import anyio
import httpx

from actors.http.tenants import parse_tenants
from actors.supervisor import Daemon, running_daemon
from tests.integration.harness import HANG_GUARD_S, PROMPT, SERVED_MODEL, MakeDaemon, sample, wait_until

HEAVY, LIGHT = "heavy-key-0001", "light-key-0002"


async def first_token_order(daemon: Daemon, url: str, held: list[dict[str, Any]], queued: list[dict[str, Any]],
                            late: dict[str, Any]) -> list[str]:
    """Start `held` (they take every slot) and `queued` behind them, then `late` once they are all in the
    engine; the labels ("held", "queued", "late") in the order their streams' first tokens came."""
    order: list[str] = []
    assert daemon.scheduler is not None
    stats = daemon.scheduler.statistics

    async def stream(http: httpx.AsyncClient, label: str, spec: dict[str, Any]) -> None:
        body = {"model": SERVED_MODEL, "prompt": PROMPT, "ignore_eos": True, "stream": True,
                "max_tokens": spec.get("max_tokens", 8), **spec.get("body", {})}
        headers = {"Authorization": f"Bearer {spec['key']}"} if "key" in spec else {}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()                   # kept: a dropped iterator closes the stream
            async for line in lines:
                if line.startswith("data: {"):
                    order.append(label)
                    break
            async for _ in lines:
                pass

    async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http, anyio.create_task_group() as tg:
        for spec in held:
            tg.start_soon(stream, http, "held", spec)
        await wait_until(lambda: stats().num_running == len(held))
        for spec in queued:
            tg.start_soon(stream, http, "queued", spec)
        await wait_until(lambda: stats().num_waiting == len(queued))
        tg.start_soon(stream, http, "late", late)
    return order


def two_tenants(make_daemon: MakeDaemon) -> Daemon:
    table = parse_tenants({"tenant": [{"name": "heavy", "key": HEAVY}, {"name": "light", "key": LIGHT}]})
    return make_daemon(gateway={"tenants": table}, max_num_seqs=2)


async def test_a_light_tenants_request_takes_a_slot_from_a_heavy_tenant_that_holds_them_all(
        make_daemon: MakeDaemon) -> None:
    daemon = two_tenants(make_daemon)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            order = await first_token_order(daemon, url, held=[{"key": HEAVY, "max_tokens": 96}] * 2,
                                            queued=[{"key": HEAVY}] * 4, late={"key": LIGHT})
            async with httpx.AsyncClient(base_url=url) as http:
                stats = (await http.get("/stats", headers={"Authorization": f"Bearer {LIGHT}"})).json()
    # Equal priorities: without preemption for fairness the light request would wait for a held one to end
    # (the queued ones then start in the same step); a held one gave its slot up instead.
    assert order == ["held", "held", "late", "queued", "queued", "queued", "queued"], order
    assert sample(daemon, "forge:fair_preemptions_total") == 1
    assert sample(daemon, "forge:num_preemptions_total") == 1
    assert stats["totals"]["fair_preemptions"] == 1 and stats["totals"]["preemptions"] == 1


async def test_two_tenants_of_equal_load_share_the_slots_without_taking_them_back(make_daemon: MakeDaemon) -> None:
    daemon = two_tenants(make_daemon)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            order = await first_token_order(daemon, url, held=[{"key": HEAVY, "max_tokens": 64}] * 2,
                                            queued=[{"key": LIGHT, "max_tokens": 64}] * 2,
                                            late={"key": LIGHT, "max_tokens": 64})
    # The light tenant takes one slot (one each), and no more: with one each, no gap is left to close.
    assert order[:3] == ["held", "held", "queued"], order
    assert sample(daemon, "forge:fair_preemptions_total") == 1
    assert sample(daemon, "forge:num_preemptions_total") == 1


async def test_without_a_tenant_file_equal_priorities_never_preempt(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(max_num_seqs=2)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            order = await first_token_order(daemon, url, held=[{"max_tokens": 48}] * 2, queued=[{}] * 2, late={})
    assert order == ["held", "held", "queued", "queued", "late"], order       # arrival order
    assert sample(daemon, "forge:num_preemptions_total") == 0
    assert sample(daemon, "forge:fair_preemptions_total") == 0


async def test_a_more_urgent_request_takes_a_slot_from_a_full_batch_and_goes_before_the_queue(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(max_num_seqs=2)
    low = {"body": {"priority": 5}}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            order = await first_token_order(daemon, url, held=[{**low, "max_tokens": 96}] * 2,
                                            queued=[low] * 3, late={"body": {"priority": -1}})
    assert order[:3] == ["held", "held", "late"], order
    assert sample(daemon, "forge:num_preemptions_total") == 1         # a held one gave its slot up


async def test_a_tenant_cannot_ask_for_more_urgency_than_its_key_allows(make_daemon: MakeDaemon) -> None:
    table = parse_tenants({"tenant": [{"name": "heavy", "key": HEAVY, "priority": 5},
                                      {"name": "light", "key": LIGHT, "priority": 5}]})
    daemon = make_daemon(gateway={"tenants": table}, max_num_seqs=2)
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            order = await first_token_order(daemon, url, held=[{"key": HEAVY, "max_tokens": 96}] * 2,
                                            queued=[{"key": HEAVY}] * 2,
                                            late={"key": LIGHT, "body": {"priority": -100}})
            await wait_until(lambda: daemon.gateway.admission.num_inflight == 0)
    # -100 counted as the tenant's 5: no preemption for priority (one for fairness, at equal priorities)
    assert sample(daemon, "forge:num_preemptions_total") == sample(daemon, "forge:fair_preemptions_total") == 1
    assert order[:2] == ["held", "held"]
