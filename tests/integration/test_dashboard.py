"""The dashboard in a real browser: Debian's chromium, driven by selenium through chromedriver,
against a live daemon with an API key, under a little load.

The page asks for the key once, then shows what /metrics says: the numbers are read off the page
(each figure carries its raw value in a data-value attribute) and compared with a scrape of
/metrics taken while the daemon is idle, and they move as requests run and complete.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, PROMPT, SERVED_MODEL, MakeDaemon, wait_idle

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextmanager
def browser() -> Iterator[WebDriver]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("the dashboard test needs Debian's chromium and chromium-driver: run scripts/install-test-deps")
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-gpu", "--no-first-run"):
        options.add_argument(arg)
    options.binary_location = chromium
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    page = webdriver.Chrome(options=options, service=Service(driver))
    try:
        yield page
    finally:
        page.quit()


def value(page: WebDriver, element_id: str) -> str:
    return page.find_element(By.ID, element_id).get_attribute("data-value") or ""


def scrape(text: str) -> dict[str, float]:
    """/metrics as {"name{label=value}": value} (summed over models), labelled samples summed under the bare
    name too."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            if labels:
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


async def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll `check` (a browser read, off the event loop) until it holds; fail naming `what`."""
    with anyio.move_on_after(timeout):
        while not await anyio.to_thread.run_sync(check):
            await anyio.sleep(0.2)
        return
    pytest.fail(f"the dashboard never showed {what}")


async def test_the_dashboard_is_one_self_contained_page_and_its_data_needs_the_key(make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"api_key": KEY})
    async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
        page = await http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "unsafe" not in policy
        assert "http://" not in page.text and "https://" not in page.text and "src=" not in page.text
        assert KEY not in page.text
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            denied = await http.get("/stats", headers=headers)
            assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        stats = (await http.get("/stats", headers=AUTH)).json()
        assert stats["status"] == "ok" and stats["serving"]["served_model_name"] == SERVED_MODEL
        kv = stats["kv"]
        assert len(kv["map"]) == kv["total_blocks"] == sum(kv["counts"].values()) == kv["counts"]["."]


async def test_the_dashboard_in_a_browser_shows_what_metrics_says_and_moves_with_the_requests(
        make_daemon: MakeDaemon) -> None:
    daemon = make_daemon(gateway={"api_key": KEY})
    with anyio.fail_after(4 * HANG_GUARD_S), browser() as page:
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            await anyio.to_thread.run_sync(page.get, f"{url}/dashboard")
            form = page.find_element(By.ID, "keyform")
            await until(lambda: form.is_displayed() and page.find_element(By.ID, "status").text == "locked",
                        "the key form")

            def enter_key(key: str) -> None:
                page.find_element(By.ID, "key").send_keys(key)
                page.find_element(By.ID, "save-key").click()

            await anyio.to_thread.run_sync(enter_key, "not-the-key")
            await until(lambda: "refused" in page.find_element(By.ID, "error").text, "a refused key")
            await anyio.to_thread.run_sync(enter_key, KEY)
            await until(lambda: page.find_element(By.ID, "status").text == "ok", "status ok")
            assert SERVED_MODEL in page.find_element(By.ID, "model").text
            assert value(page, "requests-finished") == "0"

            # A long streaming request: the page shows it running, then finished.
            async def long_stream() -> None:
                body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
                        "stream": True}
                async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as resp:
                    assert resp.status_code == 200
                    async for _ in resp.aiter_bytes():
                        if shown_running.is_set():
                            return                           # the client leaves: an abort while decoding

            shown_running = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_stream)
                await until(lambda: value(page, "running") == "1", "one running request")
                shown_running.set()

            # Three short requests that complete.
            for _ in range(3):
                body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
                assert (await http.post("/v1/completions", json=body, headers=AUTH)).status_code == 200
            await wait_idle(daemon)
            await until(lambda: value(page, "requests-finished") == "3" and value(page, "running") == "0",
                        "three finished requests")
            await anyio.sleep(1.5)                             # one more poll, of the idle daemon
            metrics = scrape((await http.get("/metrics", headers=AUTH)).text)

            shown = await anyio.to_thread.run_sync(lambda: {i: value(page, i) for i in (
                "requests-finished", "generation-tokens", "prompt-tokens", "running", "waiting", "kv-usage",
                "ttft-n", "tpot-n", "preemptions", "aborted-decode", "rejected-auth", "blocks-used",
                "blocks-shared", "blocks-free", "blocks-cached")})
            assert float(shown["requests-finished"]) == metrics["forge:request_success_total"] == 3
            assert float(shown["generation-tokens"]) == metrics["forge:generation_tokens_total"]
            assert float(shown["prompt-tokens"]) == metrics["forge:prompt_tokens_total"]
            assert float(shown["running"]) == metrics["forge:num_requests_running"] == 0
            assert float(shown["waiting"]) == metrics["forge:num_requests_waiting"] == 0
            assert float(shown["kv-usage"]) == metrics["forge:kv_cache_usage_perc"] == 0
            assert float(shown["preemptions"]) == metrics["forge:num_preemptions_total"]
            assert float(shown["aborted-decode"]) == metrics["forge:request_aborted_total{phase=decode}"] == 1
            assert float(shown["rejected-auth"]) == metrics["forge:request_rejected_total{reason=auth}"] >= 1
            assert int(shown["ttft-n"]) == metrics["forge:time_to_first_token_seconds_count"] == 4
            assert int(shown["tpot-n"]) == metrics["forge:time_per_output_token_seconds_count"] == 3
            # idle: no block is held by a request (the finished ones' blocks stay cached)
            assert shown["blocks-used"] == shown["blocks-shared"] == "0"
            errors = [e for e in page.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
            assert errors == [], errors                        # no script error, nothing blocked by the CSP

