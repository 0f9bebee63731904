"""Faults injected into the model worker: an exception in a step and non-finite logits end the affected
requests with an error (a 500 envelope, or an SSE error event before [DONE]) and the daemon serves on,
holding nothing for them afterwards."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import anyio
import httpx
import numpy as np
import pytest

from actors.supervisor import running_daemon
from forge.llm import LoadedModel
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    NotifySocket,
    assert_error,
    assert_messages_error,
    data_payloads,
    sample,
    wait_idle,
)

RAISE, NAN, STALL = 48_000, 48_001, 48_002     # prompt token ids that trip the injected faults


@pytest.fixture
def faulty(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The model's forward raises when a step computes token RAISE, returns NaN logits when it
    computes token NAN, and hangs until the returned event is set when it computes token STALL (the
    daemon under test shares the session's loaded model)."""
    forward = loaded.model.forward
    release = threading.Event()

    def injected(batch: Any, kv: Any) -> Any:
        if RAISE in batch.token_ids:
            raise RuntimeError("injected fault")
        if STALL in batch.token_ids:
            release.wait(HANG_GUARD_S)
        logits = forward(batch, kv)
        if NAN in batch.token_ids:
            logits = np.full_like(logits, np.nan)
        return logits

    monkeypatch.setattr(loaded.model, "forward", injected)
    return release


@pytest.mark.usefixtures("faulty")
async def test_a_faulty_step_fails_its_requests_and_nothing_else(make_daemon: MakeDaemon,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            for trigger in (RAISE, NAN):
                failed = await http.post("/v1/completions", json={
                    "model": SERVED_MODEL, "prompt": [trigger, 100, 200], "max_tokens": 4})
                assert_error(failed, 500, code="engine_fault", type="server_error")
            # A stream whose prompt holds the trigger: the error arrives as an event, then [DONE].
            async with http.stream("POST", "/v1/completions", json={
                    "model": SERVED_MODEL, "prompt": [RAISE, 5, 6], "max_tokens": 4, "stream": True}) as reply:
                raw = await reply.aread()
            payloads = data_payloads(raw)
            assert payloads[-1]["error"]["code"] == "engine_fault"
            # The log names the failed requests by the response ids the access log gives them.
            out = capsys.readouterr().out.splitlines()
            failed_ids = {m for line in out if "step_failed" in line for m in re.findall(r"cmpl-[0-9a-f]{32}", line)}
            answered_ids = {m for line in out if " access " in line for m in re.findall(r"cmpl-[0-9a-f]{32}", line)}
            assert len(failed_ids) == 3 and failed_ids <= answered_ids
            # The daemon serves on, and keeps nothing for the failed requests.
            ok = await http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                          "temperature": 0})
            assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["text"]
            assert (await http.get("/healthz")).status_code == 200
            await wait_idle(daemon)
    assert sample(daemon, "forge:request_failed_total") == 3


@pytest.mark.usefixtures("faulty")
async def test_a_faulty_step_fails_a_message_in_the_messages_apis_envelope(make_daemon: MakeDaemon,
                                                                           loaded: LoadedModel) -> None:
    """A message whose prompt holds the trigger: a 500 api_error body, or mid-stream an `error` event
    (and no message_stop)."""
    text = loaded.tokenizer.decode([RAISE])
    body = {"model": SERVED_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            ids = (await http.post("/tokenize", json={"messages": body["messages"]})).json()["tokens"]
            assert RAISE in ids
            failed = await http.post("/v1/messages", json=body)
            assert_messages_error(failed, 500, type="api_error", naming="engine failed")
            streamed = await http.post("/v1/messages", json={**body, "stream": True})
            events = streamed.content.decode().split("\n\n")
            assert events[0].startswith("event: message_start\n") and events[-1] == ""
            name, data = events[-2].split("\n")
            assert name == "event: error" and json.loads(data.removeprefix("data: "))["error"]["type"] == "api_error"
            assert "message_stop" not in streamed.text
            await wait_idle(daemon)


@pytest.mark.usefixtures("faulty")
async def test_a_faulty_step_fails_a_response_with_an_error_event_then_response_failed(
        make_daemon: MakeDaemon, loaded: LoadedModel) -> None:
    """A response whose prompt holds the trigger: a 500 engine_fault body, or mid-stream an `error`
    event and response.failed (no response.completed); neither is stored."""
    body = {"model": SERVED_MODEL, "max_output_tokens": 4, "input": loaded.tokenizer.decode([RAISE])}
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            failed = await http.post("/v1/responses", json=body)
            assert_error(failed, 500, code="engine_fault", type="server_error")
            streamed = await http.post("/v1/responses", json={**body, "stream": True})
            frames = [event.split("\n") for event in streamed.content.decode().split("\n\n") if event]
            names = [name.removeprefix("event: ") for name, _ in frames]
            payloads = [json.loads(data.removeprefix("data: ")) for _, data in frames]
            assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"]
            assert payloads[-2]["code"] == "engine_fault" and "engine failed" in payloads[-2]["message"]
            assert payloads[-1]["response"]["status"] == "failed"
            assert payloads[-1]["response"]["error"]["code"] == "server_error"
            assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
            stored = await http.get(f"/v1/responses/{payloads[-1]['response']['id']}")
            assert stored.status_code == 404
            await wait_idle(daemon)


async def test_a_stuck_step_turns_healthz_to_503_until_it_moves(make_daemon: MakeDaemon,
                                                                 faulty: threading.Event) -> None:
    daemon = make_daemon(gateway={"watchdog_s": 0.3})
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            assert (await http.get("/healthz")).status_code == 200
            replies: list[httpx.Response] = []

            async def stalled() -> None:
                replies.append(await http.post("/v1/completions", json={
                    "model": SERVED_MODEL, "prompt": [STALL, 7, 8], "max_tokens": 2}))

            async with anyio.create_task_group() as tg:
                tg.start_soon(stalled)
                try:
                    while (health := await http.get("/healthz")).status_code == 200:
                        await anyio.sleep(0.05)
                finally:
                    faulty.set()                                 # the step moves again
                assert health.status_code == 503 and health.json()["status"] == "stuck"
                assert health.json()["step_seconds"] >= 0.3
            assert replies[0].status_code == 200                 # and its request completes
            assert (await http.get("/healthz")).json() == {"status": "ok"}


async def test_a_stuck_step_stops_systemds_watchdog_pings_until_it_moves(
        make_daemon: MakeDaemon, faulty: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Type=notify, WATCHDOG=1 is sent only while no step runs past --watchdog: systemd restarts a
    daemon whose engine is wedged (WatchdogSec=), though its event loop still answers."""
    notify = NotifySocket()
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")                # a ping every 0.1 s
    daemon = make_daemon(gateway={"watchdog_s": 0.3})
    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                assert "READY=1" in notify.lines()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: http.post("/v1/completions", json={
                        "model": SERVED_MODEL, "prompt": [STALL, 7, 8], "max_tokens": 2}))
                    try:
                        while not any(line.startswith("STATUS=step stuck") for line in notify.lines()):
                            await anyio.sleep(0.05)
                        stuck_at = len(notify.lines())
                        await anyio.sleep(0.6)
                        assert "WATCHDOG=1" not in notify.lines()[stuck_at:], notify.lines()[stuck_at:]
                    finally:
                        faulty.set()                             # the step moves again: the pings resume
                moved_at = len(notify.lines())
                while "WATCHDOG=1" not in notify.lines()[moved_at:]:
                    await anyio.sleep(0.05)
    finally:
        notify.close()



async def test_counters_and_the_access_log_name_what_did_not_succeed(make_daemon: MakeDaemon,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    daemon = make_daemon(gateway={"api_key": "sekrit"})
    auth = {"Authorization": "Bearer sekrit"}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 401
            bad = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=auth)
            assert bad.status_code == 400
            too_long = await http.post("/v1/completions", json={"prompt": "word " * 1100, "max_tokens": 1},
                                       headers=auth)
            assert too_long.status_code == 400
            stopped = await http.post("/v1/completions", headers=auth, json={
                "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": [" Paris"]})
            assert stopped.json()["choices"][0]["finish_reason"] == "stop"          # a stop string: no abort
            whole = await http.post("/v1/completions", headers=auth, json={"prompt": PROMPT, "max_tokens": 4,
                                                                        "ignore_eos": True})
            assert whole.json()["usage"]["completion_tokens"] == 4
            async with http.stream("POST", "/v1/completions", headers=auth, json={
                    "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as reply:
                async for chunk in reply.aiter_raw():
                    if b"data: {" in chunk:
                        break                                                     # the client goes away
            with pytest.raises(httpx.ReadTimeout):                               # gone before its answer
                await http.post("/v1/completions", headers=auth, timeout=1.0, json={
                    "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
            await wait_idle(daemon)
    assert sample(daemon, "forge:request_rejected_total", {"reason": "auth"}) == 1
    assert sample(daemon, "forge:request_rejected_total", {"reason": "invalid"}) == 1
    assert sample(daemon, "forge:request_rejected_total", {"reason": "too_long"}) == 1
    assert sample(daemon, "forge:request_aborted_total", {"phase": "decode"}) == 2
    assert sample(daemon, "forge:time_per_output_token_seconds_count") >= 1
    access = [line for line in capsys.readouterr().out.splitlines() if " access " in line]
    left = [line for line in access if "client_closed=True" in line]
    assert len(left) == 2, access
    assert any("status=499" in line for line in left) and any("status=200" in line for line in left)
    assert all("response_id=cmpl-" in line for line in left)
    assert not any("status=500" in line for line in access)
    assert sample(daemon, "forge:request_aborted_total", {"phase": "queued"}) == 0
    assert sample(daemon, "forge:request_success_total", {"finished_reason": "stop"}) == 1
