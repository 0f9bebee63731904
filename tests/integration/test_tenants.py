"""Tenants through the real daemon: a request's key names its tenant (401 for a key no tenant holds), a
tenant past max_concurrent or tokens_per_minute gets 429 with Retry-After in its route's envelope, and the
counts show per tenant on /metrics and /stats. The scheduling side (priority, fair turns) is
tests/integration/test_tenant_scheduling.py."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx

from actors.http.tenants import parse_tenants
from actors.supervisor import running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    assert_messages_error,
    scraped,
    wait_until,
)

WEB, BATCH, ADMIN = "web-key-0001", "batch-key-0002", "admin-key-0003"


def tenants(*extra: dict[str, Any]) -> Any:
    return parse_tenants({"tenant": [{"name": "web", "key": WEB}, *extra]})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_key_no_tenant_holds_gets_401_and_each_tenant_key_and_the_api_key_work(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"tenants": tenants({"name": "batch", "key": BATCH}), "api_key": ADMIN})
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url) as http:
            for headers in ({}, bearer("nope-0000-0000"), bearer(WEB[:-1]), {"x-api-key": WEB}):
                assert_error(await http.post("/v1/completions", json=body, headers=headers), 401,
                             code="invalid_api_key")
            assert_messages_error(await http.post("/v1/messages", headers={"x-api-key": "nope-0000"}, json={
                "model": SERVED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}), 401)
            for key in (WEB, BATCH, ADMIN):
                assert (await http.post("/v1/completions", json=body, headers=bearer(key))).status_code == 200
            metrics = (await http.get("/metrics", headers=bearer(ADMIN))).text
            stats = (await http.get("/stats", headers=bearer(WEB))).json()
    for name in ("web", "batch", "default"):
        assert scraped(metrics, "forge:tenant_requests_total", tenant=name) == 1
        assert scraped(metrics, "forge:tenant_tokens_total", tenant=name, kind="completion") == 2
    assert scraped(metrics, "forge:request_rejected_total", reason="auth") == 5
    by_name = {t["name"]: t for t in stats["tenants"]}
    assert by_name["web"]["requests"] == 1 and by_name["web"]["completion_tokens"] == 2
    assert set(by_name) == {"web", "batch", "default"}


async def test_past_max_concurrent_a_tenant_gets_429_with_retry_after_in_each_routes_envelope(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"tenants": tenants({"name": "batch", "key": BATCH, "max_concurrent": 1})})
    long_body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            async with http.stream("POST", "/v1/completions", json=long_body, headers=bearer(BATCH)) as held:
                assert held.status_code == 200
                lines = held.aiter_lines()                       # kept: a dropped iterator closes the stream
                while not (await anext(lines)).startswith("data: {"):    # its first token: it is in flight
                    pass
                refused = await http.post("/v1/chat/completions", headers=bearer(BATCH), json={
                    "model": SERVED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                refused_messages = await http.post("/v1/messages", headers={"x-api-key": BATCH}, json={
                    "model": SERVED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
                other = await http.post("/v1/completions", headers=bearer(WEB), json={
                    "model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2})
            after = await http.post("/v1/completions", headers=bearer(BATCH), json={
                "model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2})
            metrics = (await http.get("/metrics", headers=bearer(WEB))).text
    assert_error(refused, 429, code="rate_limit_exceeded", type="requests")
    assert "max_concurrent" in refused.json()["error"]["message"]
    assert_messages_error(refused_messages, 429, type="rate_limit_error")
    for resp in (refused, refused_messages):
        assert int(resp.headers["Retry-After"]) >= 1
    assert other.status_code == 200 and after.status_code == 200       # another tenant, and the same one after
    assert scraped(metrics, "forge:request_rejected_total", reason="tenant_limit") == 2
    assert scraped(metrics, "forge:tenant_rejected_total", tenant="batch", reason="max_concurrent") == 2


async def test_a_tenant_that_used_its_tokens_per_minute_gets_429_until_its_bucket_refills(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"tenants": tenants({"name": "batch", "key": BATCH, "tokens_per_minute": 30})})
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            first = await http.post("/v1/completions", json=body, headers=bearer(BATCH))   # ~46 tokens: 16 below 0
            refused = await http.post("/v1/completions", json=body, headers=bearer(BATCH))
            refused_messages = await http.post("/v1/messages", headers={"x-api-key": BATCH}, json={
                "model": SERVED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            other = await http.post("/v1/completions", json=body, headers=bearer(WEB))
            stats = (await http.get("/stats", headers=bearer(WEB))).json()
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert used > 30
    err = assert_error(refused, 429, code="rate_limit_exceeded", type="tokens")
    assert "tokens per minute" in err["message"]
    assert_messages_error(refused_messages, 429, type="rate_limit_error")
    # the bucket is (used - 30) below zero and refills at 30 a minute: back to one token after that
    retry = int(refused.headers["Retry-After"])
    assert (used - 30) * 2 <= retry <= (used - 30 + 1) * 2 + 1, (used, retry)
    assert other.status_code == 200
    batch = next(t for t in stats["tenants"] if t["name"] == "batch")
    assert batch["rejected"] == {"tokens_per_minute": 2} and batch["tokens_left"] < 0
    assert batch["prompt_tokens"] + batch["completion_tokens"] == used


async def test_without_a_tenant_file_a_request_has_no_tenant_and_the_page_lists_none(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            resp = await http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2,
                                                           "priority": 3})
            stats = (await http.get("/stats")).json()
            await wait_until(lambda: daemon.gateway.admission.num_inflight == 0)
    assert resp.status_code == 200 and stats["tenants"] == []
    assert json.dumps(stats)                    # plain JSON types


async def test_the_dashboard_shows_each_tenants_row_with_its_counts(make_daemon: MakeDaemon) -> None:
    from selenium.webdriver.common.by import By

    from tests.integration.test_dashboard import browser, until

    daemon = make_daemon(gateway={"tenants": tenants({"name": "batch", "key": BATCH, "max_concurrent": 3,
                                                      "tokens_per_minute": 6000})})
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    with anyio.fail_after(4 * HANG_GUARD_S), browser() as page:
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            for _ in range(2):
                assert (await http.post("/v1/completions", json=body, headers=bearer(BATCH))).status_code == 200
            await anyio.to_thread.run_sync(page.get, f"{url}/dashboard")

            def enter_key() -> None:
                page.find_element(By.ID, "key").send_keys(WEB)
                page.find_element(By.ID, "save-key").click()

            await anyio.to_thread.run_sync(enter_key)

            def row(name: str) -> str:
                found = page.find_elements(By.ID, f"tenant-{name}")
                return found[0].text if found else ""

            await until(lambda: "2 requests" in row("batch"), "the batch tenant's two requests")
            batch, web = await anyio.to_thread.run_sync(lambda: (row("batch"), row("web")))
            errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert "0 of 3 in flight" in batch and "of 6,000/min left" in batch and "0 refused" in batch, batch
    assert "0 requests" in web and "/min left" not in web, web
    assert errors == [], errors                        # no script error, nothing blocked by the CSP
