"""The examples in README.md and docs/api.md, run as written against a live daemon (doc examples
that cannot rot): every curl block through bash (with curl failing on an HTTP error), and each
file's Python blocks in order in one namespace (later blocks use the `client` an earlier one made),
with only the address changed to the test daemon's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, MakeDaemon

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/api.md")
ADDRESS = "http://127.0.0.1:8080"
MODEL = "SmolLM2-135M-Instruct"                 # the name the examples send
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(doc: str, lang: str) -> list[str]:
    return [body for tag, body in FENCE.findall((ROOT / doc).read_text()) if tag == lang]


def curl_blocks(doc: str) -> list[str]:
    """Shell blocks that talk to a forge on the default address and nothing else."""
    return [b for b in blocks(doc, "sh") if b.lstrip().startswith("curl") and ADDRESS in b]


def test_the_docs_have_examples_to_run() -> None:
    assert sum(len(curl_blocks(d)) for d in DOCS) >= 5
    assert sum(len(blocks(d, "python")) for d in DOCS) >= 5


@pytest.mark.parametrize("doc", DOCS)
async def test_the_examples_of_a_doc_run_against_a_live_daemon(make_daemon: MakeDaemon, doc: str) -> None:
    daemon = make_daemon(gateway={"served_model_name": MODEL}, max_model_len=2048)
    with anyio.fail_after(4 * HANG_GUARD_S):
        async with running_daemon(daemon) as url:
            for block in curl_blocks(doc):
                script = 'curl() { command curl -sS --fail-with-body "$@"; }\n' + block.replace(ADDRESS, url)
                done = await anyio.run_process(["bash", "-euo", "pipefail", "-c", script], check=False)
                out = done.stdout.decode()
                assert done.returncode == 0, f"{block}\n-> {out} {done.stderr.decode()}"
                # an error envelope (a response object's own "error" is null)
                assert out.strip() and '"error":{' not in out and '"error": {' not in out, f"{block}\n-> {out}"
                if '"stream": true' in block:
                    # OpenAI's streams end [DONE]; the Messages API's, message_stop; the Responses API's,
                    # response.completed
                    last = out.rstrip().splitlines()[-1]
                    if "/v1/messages" in block:
                        assert last == 'data: {"type":"message_stop"}', out[-200:]
                    elif "/v1/responses" in block:
                        assert last.startswith('data: {"type":"response.completed"'), out[-200:]
                    else:
                        assert last == "data: [DONE]", out[-200:]

            namespace: dict[str, Any] = {"httpx": httpx, "__name__": "doc_example"}
            for block in blocks(doc, "python"):
                code = compile(block.replace(ADDRESS, url), f"{doc} example", "exec")
                await anyio.to_thread.run_sync(exec, code, namespace)
