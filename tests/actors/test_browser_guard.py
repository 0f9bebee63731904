"""actors.http.browser_guard's checks as pure functions: which Host, Origin and Content-Type a request may
carry, and the policy `forge serve`'s flags make."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from actors.http.browser_guard import (
    BrowserPolicy,
    normalize_host,
    normalize_origin,
    policy_for,
    split_authority,
)
from actors.http.openapi import openapi_document

LOCAL = BrowserPolicy()


def refused(policy: BrowserPolicy, method: str = "POST", **headers: str | None) -> tuple[int, str | None] | None:
    """(status, code) of the refusal of a request with these headers (None: not sent), or None."""
    sent = {k.replace("_", "-"): v for k, v in headers.items() if v is not None}
    exc = policy.refusal(method, Headers(sent))
    return None if exc is None else (exc.status, exc.code)


@pytest.mark.parametrize(("value", "parsed"), [
    ("localhost", ("localhost", None)),
    ("LocalHost:8080", ("localhost", 8080)),
    ("localhost.:80", ("localhost", 80)),
    ("127.0.0.1:8080", ("127.0.0.1", 8080)),
    ("[::1]:8080", ("::1", 8080)),
    ("[::1]", ("::1", None)),
    ("forge.example.com", ("forge.example.com", None)),
])
def test_a_host_header_splits_into_its_name_and_port(value: str, parsed: tuple[str, int | None]) -> None:
    assert split_authority(value) == parsed


@pytest.mark.parametrize("value", ["", ":80", "a b", "localhost:", "localhost:x", "localhost:99999", "[::1",
                                   "[example.com]", "::1", "evil.example/x", "localhost:80:80", "host:８０"])
def test_a_malformed_host_header_is_none(value: str) -> None:
    assert split_authority(value) is None


@pytest.mark.parametrize("host", ["localhost", "localhost:8080", "127.0.0.1:8080", "[::1]:8080", "10.1.2.3",
                                  "app.localhost:8080", "LOCALHOST"])
def test_loopback_names_and_addresses_are_known_hosts(host: str) -> None:
    assert refused(LOCAL, "GET", host=host) is None


@pytest.mark.parametrize("host", ["rebind.evil.example", "rebind.evil.example:8080", "localhost.evil.example",
                                  "127.0.0.1.evil.example", "evil.example/127.0.0.1", "", "[::1"])
def test_any_other_host_is_refused_with_421(host: str) -> None:
    assert refused(LOCAL, "GET", host=host) == (421, "host_not_allowed")


def test_allowed_hosts_widen_the_names_by_name_pattern_or_all() -> None:
    policy = BrowserPolicy(allowed_hosts=("forge.example.com", "*.lan"))
    assert refused(policy, "GET", host="forge.example.com:8000") is None
    assert refused(policy, "GET", host="box.lan") is None
    assert refused(policy, "GET", host="lan") == (421, "host_not_allowed")
    assert refused(policy, "GET", host="example.com") == (421, "host_not_allowed")
    assert refused(BrowserPolicy(allowed_hosts=("*",)), "GET", host="anything.example") is None


def test_a_request_without_a_host_header_passes_the_host_check() -> None:
    """HTTP/1.0 without Host: no browser sends one, so it cannot be a page's request."""
    assert refused(LOCAL, "GET") is None


def test_without_the_host_check_any_host_is_served_but_is_no_origin_of_its_own() -> None:
    """Bound to every interface: reached by any name, yet a page at an unknown name is a foreign one
    (what a rebound name's page would be)."""
    policy = BrowserPolicy(check_host=False)
    assert refused(policy, "GET", host="box.lan:8080") is None
    assert refused(policy, host="box.lan:8080", origin="http://box.lan:8080",
                   content_type="application/json") == (403, "origin_not_allowed")
    assert refused(policy, host="10.0.0.5:8080", origin="http://10.0.0.5:8080",
                   content_type="application/json") is None


@pytest.mark.parametrize(("origin", "host"), [
    ("http://127.0.0.1:8080", "127.0.0.1:8080"),
    ("http://localhost:8080", "LocalHost:8080"),
    ("http://localhost", "localhost"),
    ("https://localhost", "localhost"),                  # a TLS proxy before the daemon
    ("http://[::1]:8080", "[::1]:8080"),
])
def test_the_daemons_own_origin_passes(origin: str, host: str) -> None:
    assert refused(LOCAL, host=host, origin=origin, content_type="application/json") is None


@pytest.mark.parametrize(("origin", "host"), [
    ("http://evil.example", "127.0.0.1:8080"),
    ("http://127.0.0.1:3000", "127.0.0.1:8080"),         # another port is another origin
    ("http://localhost:3000", "localhost"),
    ("http://localhost:8080", "127.0.0.1:8080"),
    ("null", "127.0.0.1:8080"),                          # a sandboxed page, a file
    ("chrome-extension://abc", "127.0.0.1:8080"),
    ("http://127.0.0.1:8080", None),                     # no Host: no origin of its own
])
def test_any_other_origin_is_refused_with_403(origin: str, host: str | None) -> None:
    assert refused(LOCAL, host=host, origin=origin, content_type="application/json") == (403, "origin_not_allowed")
    assert refused(LOCAL, "GET", host=host, origin=origin) == (403, "origin_not_allowed")


def test_listed_origins_pass_and_their_preflight_too() -> None:
    policy = BrowserPolicy(allowed_origins=("https://app.example.com",))
    assert refused(policy, host="127.0.0.1:8080", origin="https://app.example.com",
                   content_type="application/json") is None
    assert refused(policy, "OPTIONS", host="127.0.0.1:8080", origin="https://app.example.com",
                   access_control_request_method="POST") is None
    assert refused(policy, "OPTIONS", host="127.0.0.1:8080", origin="https://evil.example",
                   access_control_request_method="POST") == (403, "origin_not_allowed")
    anyone = BrowserPolicy(allowed_origins=("*",))
    assert refused(anyone, host="127.0.0.1:8080", origin="null", content_type="application/json") is None


@pytest.mark.parametrize("content_type", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml", ""])
def test_a_body_that_is_not_declared_json_gets_415(content_type: str) -> None:
    assert refused(LOCAL, host="127.0.0.1", content_type=content_type) == (415, "unsupported_media_type")


@pytest.mark.parametrize("content_type", ["application/json", "Application/JSON; charset=utf-8"])
def test_json_and_no_content_type_pass(content_type: str) -> None:
    assert refused(LOCAL, host="127.0.0.1", content_type=content_type) is None
    assert refused(LOCAL, host="127.0.0.1") is None
    assert refused(LOCAL, "GET", host="127.0.0.1", content_type="text/plain") is None     # no body to read


@pytest.mark.parametrize(("value", "normal"), [
    ("HTTPS://App.Example.com:443/", "https://app.example.com"),
    ("http://localhost:3000", "http://localhost:3000"),
    ("http://[::1]:80", "http://[::1]"),
    ("chrome-extension://abcdef", "chrome-extension://abcdef"),
    ("*", "*"),
    ("null", "null"),
])
def test_origins_are_written_as_browsers_send_them(value: str, normal: str) -> None:
    assert normalize_origin(value) == normal


@pytest.mark.parametrize("value", ["app.example.com", "https://", "https://app.example.com/path", "://x"])
def test_what_is_not_an_origin_is_refused_by_name(value: str) -> None:
    with pytest.raises(ValueError, match="not an origin"):
        normalize_origin(value)


def test_allowed_host_entries_drop_their_port() -> None:
    assert [normalize_host(h) for h in ("Forge.Example.com:8000", "*.Lan", "*", "[::1]", "::1")] == [
        "forge.example.com", "*.lan", "*", "::1", "::1"]
    with pytest.raises(ValueError, match="not a host name"):
        normalize_host("http://forge.example.com")


def test_the_flags_policy_checks_hosts_unless_listening_everywhere() -> None:
    assert policy_for("127.0.0.1:8080", allowed_hosts=None, allowed_origins=None) == BrowserPolicy()
    assert not policy_for("0.0.0.0:8080", allowed_hosts=None, allowed_origins=None).check_host
    assert not policy_for("[::]:8080", allowed_hosts=None, allowed_origins=None).check_host
    everywhere = policy_for("0.0.0.0:8080", allowed_hosts="forge.example.com", allowed_origins="https://a.example")
    assert everywhere == BrowserPolicy(allowed_hosts=("forge.example.com",), check_host=True,
                                       allowed_origins=("https://a.example",))
    assert policy_for("box.lan:8080", allowed_hosts=None, allowed_origins=None).allowed_hosts == ("box.lan",)
    assert policy_for("unix:/run/forge.sock", allowed_hosts=None, allowed_origins=None).check_host
    with pytest.raises(ValueError, match="not an origin"):
        policy_for("127.0.0.1:8080", allowed_hosts=None, allowed_origins="example.com")


def test_the_openapi_document_declares_what_the_guard_answers() -> None:
    """A client generated from /openapi.json (and the schema fuzzer's status check) knows the guard's
    answers: 421 and 403 on every operation, the routes open without the key included, and 415 on every
    one that takes a body."""
    for path, methods in openapi_document()["paths"].items():
        for method, op in methods.items():
            statuses = set(op["responses"])
            assert {"403", "421"} <= statuses, (method, path)
            if "requestBody" in op:
                assert "415" in statuses, (method, path)
