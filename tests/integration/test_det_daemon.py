"""A daemon serving the deterministic numerics (`numerics="deterministic"`), as a user sees it: it says so in
/metrics, and a request answered again from the prefix cache gives the same tokens and the same logprobs
to the bit (the JSON's digits), where the cached prefix's K/V were computed in another step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx

from actors.http.gateway import GatewayConfig
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, engine_config, scraped

TEXT = ("The lighthouse on Gull Rock was built in 1871 by the harbour board. Its lamp burned paraffin until "
        "1934, when an electric lamp replaced it. The keeper, Thomas Reed, kept a log of every ship that "
        "passed, and his daughter Mary rowed out to rescue the crew of the schooner Alba in the storm of 1889. ")


async def test_a_cached_prompt_answers_to_the_bit(default_model_path: Path) -> None:
    body: dict[str, Any] = {"model": SERVED_MODEL, "prompt": TEXT * 2, "max_tokens": 8, "temperature": 0,
                            "logprobs": 3}
    with anyio.fail_after(HANG_GUARD_S):
        # its own load of the model, in these numerics (make_daemon's is the reference's, loaded once)
        daemon = Daemon(DaemonConfig(engine=engine_config(numerics="deterministic"),
                                     gateway=GatewayConfig(served_model_name=SERVED_MODEL),
                                     model=str(default_model_path)))
        async with running_daemon(daemon) as url, \
                httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            first = (await http.post("/v1/completions", json=body)).json()
            again = (await http.post("/v1/completions", json=body)).json()
            metrics = (await http.get("/metrics")).text
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16 > 0
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]      # every digit of every logprob
    assert scraped(metrics, "forge:kernels_info", model_name=SERVED_MODEL, backend="blocks",
                   numerics="deterministic", attention="compiled") == 1
