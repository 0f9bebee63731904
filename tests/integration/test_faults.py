"""Faults injected into the model worker: an exception in a step and non-finite logits end the affected
requests with an error (a 500 envelope, or an SSE error event before [DONE]) and the daemon serves on,
holding nothing for them afterwards."""

from __future__ import annotations

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
    assert_error,
    data_payloads,
    sample,
    wait_idle,
)

RAISE, NAN = 48_000, 48_001        # prompt token ids that trip the injected faults


@pytest.fixture
def faulty(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's forward raises when a step computes token RAISE and returns NaN logits when it
    computes token NAN (the daemon under test shares the session's loaded model)."""
    forward = loaded.model.forward

    def injected(batch: Any, kv: Any) -> Any:
        if RAISE in batch.token_ids:
            raise RuntimeError("injected fault")
        logits = forward(batch, kv)
        if NAN in batch.token_ids:
            logits = np.full_like(logits, np.nan)
        return logits

    monkeypatch.setattr(loaded.model, "forward", injected)


@pytest.mark.usefixtures("faulty")
async def test_a_faulty_step_fails_its_requests_and_nothing_else(make_daemon: MakeDaemon) -> None:
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
            # The daemon serves on, and keeps nothing for the failed requests.
            ok = await http.post("/v1/completions", json={"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                          "temperature": 0})
            assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["text"]
            assert (await http.get("/healthz")).status_code == 200
            await wait_idle(daemon)
    assert sample(daemon, "forge:request_failed_total") == 3
