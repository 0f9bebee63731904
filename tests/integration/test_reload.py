"""`systemctl reload` through a real `forge serve` process, this test playing systemd: SIGHUP with a changed
tenant file and environment file makes a new key work and a removed key get 401 while a stream started
before it runs to its end; the notify socket sees RELOADING=1 (with MONOTONIC_USEC) then READY=1; a
malformed file on reload keeps the old table and logs one error line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx

from tests.integration.harness import HANG_GUARD_S, PROMPT, NotifySocket, free_port, wait_healthy, wait_until

REPO = Path(__file__).resolve().parents[2]
OLD, NEW = "old-tenant-key-1", "new-tenant-key-2"


def tenant_file(path: Path, **keys: str) -> None:
    path.write_text("".join(f'[[tenant]]\nname = "{name}"\nkey = "{key}"\n' for name, key in keys.items()))


def log_events(log: Path, event: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


async def test_a_reload_swaps_the_tenants_and_the_log_level_without_dropping_a_stream(
        tmp_path: Path, default_model_path: Path) -> None:
    keys, env_file, log = tmp_path / "keys.toml", tmp_path / "forge.env", tmp_path / "forge.log"
    tenant_file(keys, old=OLD)
    env_file.write_text(f"FORGE_API_KEYS_FILE={keys}\nFORGE_LOG=info\nFORGE_MAX_WAITING=256\n")
    port, notify = free_port(), NotifySocket()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    env.update(FORGE_HOME=str(default_model_path.parent.parent), FORGE_DOWNLOAD="0",
               FORGE_ADDR=f"127.0.0.1:{port}", FORGE_API_KEYS_FILE=str(keys), FORGE_LOG="info",
               FORGE_MAX_WAITING="256", FORGE_ENV_FILE=str(env_file), NOTIFY_SOCKET=notify.address,
               PYTHONPATH=str(REPO))                  # this checkout's forge, whatever is installed
    with open(log, "wb") as out:
        proc = await anyio.open_process([sys.executable, "-m", "actors", "serve"], stdout=out,
                                        stderr=subprocess.STDOUT, env=env, cwd=tmp_path)

    async def reload_and_wait() -> None:
        num_ready = notify.lines().count("READY=1")
        proc.send_signal(signal.SIGHUP)
        await wait_until(lambda: notify.lines().count("READY=1") > num_ready, interval=0.05)

    def completion(key: str) -> Any:
        return http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                         headers={"Authorization": f"Bearer {key}"})

    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, log.read_text)
                assert (await completion(OLD)).status_code == 200
                assert (await completion(NEW)).status_code == 401
                body = {"prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/completions", json=body,
                                       headers={"Authorization": f"Bearer {OLD}"}) as stream:
                    lines = stream.aiter_lines()             # kept: a dropped iterator closes the stream
                    while not (await anext(lines)).startswith("data: {"):
                        pass
                    tenant_file(keys, new=NEW)
                    env_file.write_text(f"FORGE_API_KEYS_FILE={keys}\nFORGE_LOG=debug\nFORGE_MAX_WAITING=7\n")
                    await reload_and_wait()
                    assert (await completion(NEW)).status_code == 200
                    refused = await completion(OLD)
                    rest = [line async for line in lines if line.startswith("data: ")]
                assert refused.status_code == 401
                assert rest[-1] == "data: [DONE]"
                usage = json.loads(rest[-2][len("data: "):])["usage"]
                assert usage["completion_tokens"] == 120                 # the whole stream, across the reload

                keys.write_text('[[tenant]]\nname = "broken"\nkey = ')          # malformed: the old table stays
                await reload_and_wait()
                assert (await completion(NEW)).status_code == 200
                assert (await completion(OLD)).status_code == 401
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        notify.close()
    messages = notify.messages
    reloading = [m for m in messages if "RELOADING=1" in m]
    assert len(reloading) == 2 and all(any(line.startswith("MONOTONIC_USEC=") for line in m) for m in reloading)
    lines = notify.lines()
    first = lines.index("RELOADING=1")
    assert "READY=1" in lines[first:] and lines.index("READY=1") < first           # ready, reloading, ready
    [reloaded] = log_events(log, "reloaded")
    assert reloaded["log_level"] == "debug" and reloaded["tenants"] == 1
    [restart] = log_events(log, "reload_needs_restart")
    assert restart["variables"] == ["FORGE_MAX_WAITING"]
    [failed] = log_events(log, "reload_failed")
    assert str(keys) in failed["error"] and failed["level"] == "error"
