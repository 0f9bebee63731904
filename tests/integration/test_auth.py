"""The API key: every route needs it but /healthz (for load balancers), /health (the same, for LLM routers)
and the dashboard's page (which holds no data and asks for the key itself), and every place that says which
routes are open names those three; missing, wrong and almost-right keys get 401;
the key never appears in a log line, whatever was sent. The Messages API's routes answer in that API's
envelope and take the key as `x-api-key` too (only there)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import anyio
import httpx
import pytest

from actors.supervisor import running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    assert_messages_error,
    assert_ollama_error,
)

KEY = "s3cret-Key-0042"
OPEN = {"/healthz", "/health", "/dashboard"}     # /health: what LLM routers wait for
MESSAGES = {"/v1/messages", "/v1/messages/count_tokens"}   # the Messages API's: its error envelope
ALMOST = [KEY[:-1], KEY + "3", KEY.lower(), " " + KEY, f"{KEY[:4]} {KEY[4:]}", KEY.replace("0", "O")]


async def test_every_route_but_health_and_the_page_needs_the_key_and_it_is_never_logged(
        make_daemon: MakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    daemon = make_daemon(gateway={"api_key": KEY})
    app_routes = {(route.path, method) for route in daemon.gateway.app().routes
                  for method in (getattr(route, "methods", None) or ()) if method != "HEAD"}
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url) as http:
            for path, method in sorted(app_routes):
                if path in OPEN:
                    assert (await http.request(method, path)).status_code == 200, path
                    continue
                refused: list[dict[str, str]] = [{}, *({"Authorization": f"Bearer {k}"} for k in ALMOST),
                                                 {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
                # The Messages API's routes take the key as x-api-key too (tests/integration/test_messages_api.py);
                # a header value cannot start with a space
                almost = [{"X-Api-Key": k} for k in ALMOST if k == k.strip()]
                refused += almost if path in MESSAGES else [{"X-Api-Key": KEY}]
                for headers in refused:
                    resp = await http.request(method, path, json=body if method == "POST" else None,
                                              headers=headers)
                    if path in MESSAGES:
                        assert_messages_error(resp, 401, type="authentication_error")
                    elif path.startswith("/api/"):           # Ollama's routes: its error object
                        assert_ollama_error(resp, 401, naming="API key")
                    else:
                        assert_error(resp, 401, type="authentication_error")
                    assert KEY not in resp.text
            ok = await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200
    assert {path for path, _ in app_routes} >= {"/v1/completions", "/v1/chat/completions", "/metrics", "/stats",
                                                "/openapi.json", "/tokenize", "/v1/responses",
                                                "/v1/responses/{response_id}", "/api/chat", "/api/tags", *MESSAGES}
    logs = capsys.readouterr()
    assert "401" in logs.out + logs.err                        # the refusals were logged...
    assert KEY not in logs.out and KEY not in logs.err         # ...without the key
    assert KEY[:-1] not in logs.out + logs.err               # nor the almost-right ones


def test_the_help_and_every_doc_name_the_same_open_routes_as_the_gateway_keeps() -> None:
    """--help, docs/configuration.md, docs/reliability.md, docs/operations.md and the environment file's
    example each say which routes need no key: exactly OPEN, the ones the test above finds open."""
    from actors.daemon_cli import register
    from forge.core_cli import build_parser

    root = Path(__file__).resolve().parents[2]
    parser = build_parser(register)
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    statements = {
        "--help": next(a.help or "" for a in serve._actions if "--api-key" in a.option_strings),
        "docs/configuration.md": _line(root / "docs/configuration.md", "| `--api-key KEY`"),
        "docs/reliability.md": _sentence(root / "docs/reliability.md", "With `FORGE_API_KEY` set, every route"),
        "docs/operations.md": _sentence(root / "docs/operations.md", "With `FORGE_API_KEY` set, every route"),
        "deploy/forge.env.example": _line(root / "deploy/forge.env.example", "# When set, every route"),
    }
    for where, text in statements.items():
        named = set(re.findall(r"(?<![\w.$])/[a-z][a-z_/]*", text)) - {"/metrics"}   # /metrics: named as keyed
        assert named == OPEN, (where, text)


def _line(path: Path, start: str) -> str:
    return next(line for line in path.read_text().splitlines() if line.startswith(start))


def _sentence(path: Path, start: str) -> str:
    text = path.read_text()
    at = text.index(start)
    return text[at:text.index(". ", at) if ". " in text[at:] else len(text)].replace("\n", " ")
