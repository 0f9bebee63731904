"""What an open dashboard costs the engine: 32-stream load with and without the page open.

Runs against a forge daemon you started (`forge serve --addr 127.0.0.1:8282 --max-num-seqs 32`):
after one unreported warm-up run, arms alternate (none, poll, browser, none, ...), each a
closed-loop run of the mixed workload. "poll" fetches /stats once a second, as an open dashboard
does: the daemon's whole share of the cost (the page watched from another machine). "browser"
opens /dashboard in headless chromium on this machine: the worst case, the browser's own rendering
competing for the same cores. Reported per arm: the mean engine step time (from
forge:step_duration_seconds over the run), output tok/s, and the ITL p50/p99 the clients saw.
With --screenshot PATH it also saves the page, under that load, as a PNG.

    .venv/bin/python scripts/ab/ab_dashboard.py --base http://127.0.0.1:8282 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from forge.models.hub import resolve_model
from forge.text.tokenizer import Tokenizer
from forge_bench import loadgen


def step_totals(base: str, headers: dict[str, str]) -> tuple[float, float]:
    text = httpx.get(f"{base}/metrics", headers=headers).text
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return got.get("forge:step_duration_seconds_sum", 0.0), got.get("forge:step_duration_seconds_count", 0.0)


@contextmanager
def dashboard(base: str, key: str | None, size: str = "1400,1050") -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={size}",
                "--hide-scrollbars"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "chromium"
    page = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "chromedriver"))
    try:
        page.get(f"{base}/dashboard")
        if key:
            time.sleep(0.5)
            page.find_element(By.ID, "key").send_keys(key)
            page.find_element(By.ID, "save-key").click()
        yield page
    finally:
        page.quit()


def run_arm(base: str, workload: loadgen.Workload, args: argparse.Namespace, headers: dict[str, str],
            screenshot: str | None) -> dict[str, Any]:
    before = step_totals(base, headers)

    async def load() -> tuple[list[loadgen.RequestResult], float]:
        return await loadgen.run_closed_loop(base, workload, args.concurrency, args.requests, progress=False,
                                             api_key=args.api_key)

    if args.arm == "poll":
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=base, headers=headers) as client:
                while not stop.wait(1.0):
                    client.get("/stats").raise_for_status()

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            results, wall = anyio.run(load)
        finally:
            stop.set()
            poller.join()
    elif args.arm == "browser":
        with dashboard(base, args.api_key) as page:
            timer = threading.Timer(args.screenshot_after, page.save_screenshot, [screenshot])
            if screenshot:                 # mid-run, with every stream going
                timer.start()
            try:
                results, wall = anyio.run(load)
            finally:
                timer.cancel()
                if timer.is_alive():
                    timer.join()
    else:
        results, wall = anyio.run(load)
    after = step_totals(base, headers)
    summary = loadgen.summarize(results, wall, ttft_slo=10.0, tpot_slo=0.5)
    steps = after[1] - before[1]
    return {"arm": args.arm, "steps": int(steps), "step_ms": 1000 * (after[0] - before[0]) / steps if steps else None,
            "output_tok_s": summary["output_tok_s"], "itl_p50_ms": 1000 * (summary["itl_p50"] or 0),
            "itl_p99_ms": 1000 * (summary["itl_p99"] or 0), "errors": summary["errors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8282")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--screenshot", default=None, help="save the page under load (last browser arm)")
    parser.add_argument("--screenshot-after", type=float, default=20.0, help="seconds into that arm")
    parser.add_argument("--screenshot-only", action="store_true", help="one browser run for the screenshot")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    workload = loadgen.build_workload(Tokenizer.from_gguf(resolve_model(None, lambda _: None)), num_requests=96,
                                      max_tokens=args.max_tokens)
    if args.screenshot_only:
        args.arm = "browser"
        print(json.dumps(run_arm(args.base, workload, args, headers, args.screenshot)))
        return
    args.arm = "warm-up"           # once, unreported: every arm then meets the same warm prefix cache
    run_arm(args.base, workload, args, headers, None)
    rows = []
    for r in range(args.rounds):
        for arm in ("none", "poll", "browser"):
            args.arm = arm
            last = r == args.rounds - 1
            row = run_arm(args.base, workload, args, headers, args.screenshot if last else None)
            row["round"] = r + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| dashboard | round | engine steps | mean step ms | output tok/s | ITL p50 ms | ITL p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['round']} | {row['steps']} | {row['step_ms']:.1f} | {row['output_tok_s']:.1f} "
              f"| {row['itl_p50_ms']:.0f} | {row['itl_p99_ms']:.0f} |")


if __name__ == "__main__":
    main()
