"""What a web page can make a browser do to a daemon on loopback, through real hypercorn: a rebound
name (a foreign Host) is refused on every route; a cross-site POST (text/plain, which a browser sends
without a preflight) is refused and changes nothing; a listed origin gets CORS, its preflight
answered; no redirect points at the host a request named; a body not sent as JSON gets 415 in its
route's envelope (docs/reliability.md, "What a web page can do")."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import anyio
import httpx
from starlette.routing import Route

from actors.http.browser_guard import BrowserPolicy
from actors.http.gateway import GatewayConfig
from actors.runtime.model_set import ModelEntry
from actors.supervisor import Daemon, DaemonConfig, running_daemon
from tests.integration.harness import (
    HANG_GUARD_S,
    PROMPT,
    SERVED_MODEL,
    MakeDaemon,
    assert_error,
    assert_messages_error,
    assert_ollama_error,
    engine_config,
    generated_tokens,
    long_prompt,
    sample,
    wait_idle,
)
from tests.integration.test_nginx import needs_nginx, running_nginx

EVIL = "http://evil.example"
REBOUND = "rebind.evil.example"
COMPLETION = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}


def every_route(daemon: Daemon) -> list[tuple[str, str]]:
    """(method, path) of every route the gateway serves, path parameters filled in."""
    out = []
    for route in daemon.gateway.app().routes:
        assert isinstance(route, Route) and route.methods
        for method in sorted(route.methods - {"HEAD"}):
            out.append((method, re.sub(r"\{[^}]+\}", "resp_x", route.path)))
    return out


def assert_refused(resp: httpx.Response, path: str, status: int, code: str) -> None:
    """A refusal in the envelope of the route at `path`, never a redirect."""
    assert "location" not in resp.headers, resp.headers
    if path.startswith("/v1/messages"):
        assert_messages_error(resp, status)
    elif path.startswith("/api/"):
        assert_ollama_error(resp, status)
    else:
        assert_error(resp, status, code=code)


async def test_a_foreign_host_is_refused_on_every_route(make_daemon: MakeDaemon) -> None:
    """A name rebound to 127.0.0.1 reaches the daemon with that name as its Host: 421 everywhere,
    /healthz and /metrics included, so a page on that name reads nothing; loopback names pass."""
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            port = url.rsplit(":", 1)[1]
            routes = every_route(daemon)
            assert ("GET", "/healthz") in routes and ("POST", "/flush_cache") in routes
            for method, path in [*routes, ("GET", "/no/such/route")]:
                for host in (REBOUND, f"{REBOUND}:{port}"):
                    resp = await http.request(method, path, headers={"Host": host}, json={})
                    assert_refused(resp, path, 421, "host_not_allowed")
            for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "app.localhost"):
                assert (await http.get("/healthz", headers={"Host": host})).status_code == 200, host
            refused = sample(daemon, "forge:request_rejected_total", {"reason": "cross_site"})
            assert refused == 2 * (len(routes) + 1)
            assert generated_tokens(daemon) == 0


async def test_a_cross_site_post_is_refused_and_changes_nothing(make_daemon: MakeDaemon) -> None:
    """What a page on another site sends without asking first: a text/plain POST carrying its Origin,
    to the daemon's own Host or to a rebound one. The completion does not run and the prefix cache
    is not flushed; the same requests from the daemon's own origin do both."""
    daemon = make_daemon()
    prompt = {"prompt": long_prompt(40), "max_tokens": 1, "temperature": 0}
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            host = url.removeprefix("http://")
            first = await http.post("/v1/completions", json=prompt)
            assert first.status_code == 200
            before = generated_tokens(daemon)
            for headers, status, code in [
                ({"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"}, 403, "origin_not_allowed"),
                ({"Origin": EVIL, "Content-Type": "application/json"}, 403, "origin_not_allowed"),
                ({"Origin": EVIL}, 403, "origin_not_allowed"),
                ({"Origin": EVIL, "Host": REBOUND, "Content-Type": "text/plain"}, 421, "host_not_allowed"),
                ({"Origin": f"http://{REBOUND}", "Host": REBOUND, "Content-Type": "text/plain"}, 421,
                 "host_not_allowed"),
                ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),      # a page that sent no Origin
                ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
                ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "unsupported_media_type"),
            ]:
                for path in ("/v1/completions", "/flush_cache", "/v1/messages", "/api/chat", "/api/generate"):
                    resp = await http.post(path, content=json.dumps(COMPLETION), headers=headers)
                    assert_refused(resp, path, status, code)
            assert generated_tokens(daemon) == before                   # no completion ran
            again = await http.post("/v1/completions", json=prompt, headers={"Origin": f"http://{host}"})
            assert again.status_code == 200                             # the daemon's own origin
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0     # not flushed
            own = {"Origin": f"http://{host}", "Content-Type": "application/json"}
            assert (await http.post("/flush_cache", headers=own)).status_code == 200
            flushed = await http.post("/v1/completions", json=prompt)
            assert flushed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await wait_idle(daemon)


async def test_a_cross_site_post_does_not_unload_a_model(default_model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "second.gguf"
    shutil.copyfile(default_model_path, copy)
    entries = [ModelEntry(model_id=name, source=str(path), size_bytes=path.stat().st_size)
               for name, path in (("first", default_model_path), ("second", copy))]
    daemon = Daemon(DaemonConfig(engine=engine_config(kv_cache_memory=64 * 2**20), gateway=GatewayConfig(),
                                 models=entries, drain_timeout=5.0))
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            assert (await http.post("/models/load", json={"model": "first"})).status_code == 200
            body = json.dumps({"model": "first"})
            for headers in ({"Origin": EVIL, "Content-Type": "text/plain"}, {"Content-Type": "text/plain"}):
                resp = await http.post("/models/unload", content=body, headers=headers)
                assert resp.status_code in (403, 415), resp.text
            models = (await http.get("/v1/models")).json()["data"]
            assert {m["id"]: m["state"] for m in models}["first"] == "loaded"


async def test_an_allowed_origin_gets_cors_and_its_preflight_answered(make_daemon: MakeDaemon) -> None:
    app = "https://app.example"
    daemon = make_daemon(gateway={"browser": BrowserPolicy(allowed_origins=(app,))})
    asked = "authorization, content-type, x-stainless-os, x-stainless-retry-count, anthropic-version, x-api-key"
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            for path in ("/v1/chat/completions", "/v1/messages"):
                pre = await http.options(path, headers={"Origin": app, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": asked})
                assert pre.status_code == 200, pre.text
                assert pre.headers["access-control-allow-origin"] == app
                assert "POST" in pre.headers["access-control-allow-methods"]
                allowed = {h.strip() for h in pre.headers["access-control-allow-headers"].split(",")}
                assert {h.strip() for h in asked.split(",")} <= allowed
                assert "Origin" in pre.headers["vary"]
            resp = await http.post("/v1/completions", json=COMPLETION, headers={"Origin": app})
            assert resp.status_code == 200
            assert resp.headers["access-control-allow-origin"] == app and "Origin" in resp.headers["vary"]
            assert "X-Request-ID" in resp.headers["access-control-expose-headers"]
            # A body in another type: the page reads why, in its route's envelope.
            wrong = await http.post("/v1/messages", content=b"{}",
                                    headers={"Origin": app, "Content-Type": "text/plain"})
            assert_messages_error(wrong, 415, naming="application/json")
            assert wrong.headers["access-control-allow-origin"] == app
            # Another origin: no preflight answer, no request.
            other = await http.options("/v1/completions",
                                       headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
            assert_error(other, 403, code="origin_not_allowed")
            assert "access-control-allow-origin" not in other.headers
            await wait_idle(daemon)


async def test_a_trailing_slash_never_redirects_to_the_host_named(make_daemon: MakeDaemon) -> None:
    """/healthz/ is a 404 naming /healthz, whatever the Host; never a Location (starlette's slash
    redirect was an absolute URL on the request's Host), also with the Host check off."""
    for policy in (BrowserPolicy(), BrowserPolicy(check_host=False)):
        daemon = make_daemon(gateway={"browser": policy})
        with anyio.fail_after(HANG_GUARD_S):
            async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
                for host in (REBOUND, "localhost"):
                    resp = await http.get("/healthz/", headers={"Host": host})
                    assert "location" not in resp.headers
                    if policy.check_host and host == REBOUND:
                        assert_error(resp, 421, code="host_not_allowed")
                    else:
                        assert "/healthz is one" in assert_error(resp, 404)["message"]
                assert "location" not in (await http.post("/v1/completions/", json=COMPLETION)).headers


async def test_the_dashboards_own_requests_pass(make_daemon: MakeDaemon) -> None:
    """What the dashboard's page sends (same-origin: its Origin, when sent, is the daemon's own) is
    served; tests/integration/test_dashboard.py drives the page itself in chromium."""
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            page = await http.get("/dashboard")
            assert page.status_code == 200
            stats = await http.get("/stats", headers={"Origin": url, "Referer": f"{url}/dashboard"})
            assert stats.status_code == 200, stats.text
            assert (await http.get("/stats", headers={"Origin": EVIL})).status_code == 403


async def test_curl_without_a_content_type_header_is_told_what_to_send(make_daemon: MakeDaemon) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded: 415 naming the header to add. A
    body with no Content-Type at all (no browser sends one) is served."""
    daemon = make_daemon()
    with anyio.fail_after(HANG_GUARD_S):
        async with running_daemon(daemon) as url, httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            raw = json.dumps({**COMPLETION, "model": SERVED_MODEL}).encode()
            form = await http.post("/v1/completions", content=raw,
                                   headers={"Content-Type": "application/x-www-form-urlencoded"})
            error = assert_error(form, 415, code="unsupported_media_type")
            assert "Content-Type: application/json" in error["message"]
            assert (await http.post("/v1/completions", content=raw)).status_code == 200
            await wait_idle(daemon)


@needs_nginx
async def test_behind_deploys_nginx_the_public_name_answers_once_allowed(make_daemon: MakeDaemon,
                                                                          tmp_path: Path) -> None:
    """deploy/nginx/forge.conf passes the client's Host on, port included: the site's public name,
    once in --allowed-hosts, reaches every route (/healthz's own location too) and its pages are
    the daemon's own; a rebound name is still refused through the proxy."""
    daemon = make_daemon(gateway={"browser": BrowserPolicy(allowed_hosts=("forge.example.com",))})
    with anyio.fail_after(HANG_GUARD_S):
        async with (running_daemon(daemon) as url, running_nginx(tmp_path, int(url.rsplit(":", 1)[1])) as proxy,
                    httpx.AsyncClient(base_url=proxy, timeout=HANG_GUARD_S) as http):
            public = f"forge.example.com:{proxy.rsplit(':', 1)[1]}"
            assert (await http.get("/healthz", headers={"Host": public})).status_code == 200
            own = await http.post("/v1/completions", json=COMPLETION,
                                  headers={"Host": public, "Origin": f"http://{public}"})
            assert own.status_code == 200, own.text
            foreign = await http.post("/v1/completions", json=COMPLETION,
                                      headers={"Host": public, "Origin": EVIL})
            assert_error(foreign, 403, code="origin_not_allowed")
            for path in ("/healthz", "/v1/completions"):
                rebound = await http.post(path, json=COMPLETION, headers={"Host": f"{REBOUND}:80"})
                assert_refused(rebound, path, 421, "host_not_allowed")
            await wait_idle(daemon)
