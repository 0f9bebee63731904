"""What a web page may make the daemon do: the Host, Origin and Content-Type checks at the edge.

Any page a user opens can make the browser send requests to a daemon on loopback or the LAN (a form,
a fetch with a text/plain body, a name of the page's site rebound to 127.0.0.1). Before any route
runs, three checks keep such a page from driving the daemon or reading its replies:

- Host: the name the request was sent to is one the daemon answers to (localhost, IP addresses, the
  name it listens on, --allowed-hosts); a rebound name of someone else's site is not (421).
- Origin: a page's request carries its origin; one that is neither the daemon's own nor listed in
  --allowed-origins is refused (403). A listed origin gets CORS (starlette's CORSMiddleware, inside).
- Content-Type: what a page may send cross-site without asking first (a form, text) is refused (415);
  the JSON routes take `application/json`, or no Content-Type at all (no browser sends a body so).

Refusals are RequestErrors in the envelope of the route asked for (actors.http.edge).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from actors.http.edge import error_response_for
from forge.errors import RequestError

DEFAULT_PORTS = {"http": 80, "https": 443}
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::", "[::]")   # bound to every interface
BODILESS_METHODS = ("GET", "HEAD", "OPTIONS")
HOST_NOT_ALLOWED = "host_not_allowed"
ORIGIN_NOT_ALLOWED = "origin_not_allowed"

_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


def split_authority(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an origin's authority) as (name, port): 'Example.COM.:8080' ->
    ('example.com', 8080), '[::1]' -> ('::1', None); None when it is not one."""
    text = value.strip().lower()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or not _is_ip(host) or ":" not in host:
            return None
    else:
        host, colon, rest = text.partition(":")
        rest = colon + rest
        host = host.removesuffix(".")                   # the root's dot: the same name
        if not (_NAME.fullmatch(host) or _is_ip(host)):
            return None
    if not rest:
        return host, None
    digits = rest[1:]
    if not rest.startswith(":") or not (digits.isascii() and digits.isdigit()) or int(digits) > 65535:
        return None
    return host, int(digits)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def normalize_host(value: str) -> str:
    """An --allowed-hosts entry: a name (its port, if any, dropped: Hosts match on the name),
    `*.example.com` (every name under it) or `*` (any). ValueError for anything else."""
    text = value.strip().lower()
    if text == "*" or _is_ip(text):
        return text
    under = text.startswith("*.")
    parsed = split_authority(text[2:] if under else text)
    if parsed is None:
        raise ValueError(f"not a host name: {value!r} (e.g. forge.example.com, *.example.com or *)")
    return f"*.{parsed[0]}" if under else parsed[0]


def normalize_origin(value: str) -> str:
    """An origin as browsers write it: 'HTTPS://App.example.com:443/' -> 'https://app.example.com';
    `*` (any) and `null` (sandboxed pages, files) as they are. ValueError for anything else."""
    text = value.strip().lower().removesuffix("/")
    if text in ("*", "null"):
        return text
    scheme, sep, authority = text.partition("://")
    parsed = split_authority(authority) if sep and _SCHEME.fullmatch(scheme) else None
    if parsed is None:
        raise ValueError(f"not an origin: {value!r} (scheme://host[:port], e.g. https://app.example.com, or *)")
    host, port = parsed
    name = f"[{host}]" if ":" in host else host
    return f"{scheme}://{name}" if port is None or port == DEFAULT_PORTS.get(scheme) else f"{scheme}://{name}:{port}"


def parse_list(text: str | None, normalize: Callable[[str], str]) -> tuple[str, ...]:
    """A comma-separated list (a flag's or a variable's value), each entry normalized; empty ones skipped."""
    return tuple(normalize(part) for part in (text or "").split(",") if part.strip())


def _listen_host(addr: str) -> str | None:
    """The host part of a listen address HOST:PORT (or HOST); None for a socket file or an inherited fd."""
    if addr.startswith(("fd://", "unix:")):
        return None
    return addr.rpartition(":")[0] if ":" in addr else addr


def is_wildcard(addr: str) -> bool:
    """Whether a listen address binds every interface (0.0.0.0, ::, or no host)."""
    host = _listen_host(addr)
    return host is not None and host.lower() in WILDCARD_ADDRESSES


def listen_name(addr: str) -> str | None:
    """The host name a listen address names, when it is a name and not an address (forge.lan:8080)."""
    host = _listen_host(addr)
    parsed = split_authority(host) if host else None
    return parsed[0] if parsed is not None and not _is_ip(parsed[0]) else None


def is_json(content_type: str) -> bool:
    """Whether a Content-Type is JSON's: application/json, whatever its parameters (charset)."""
    return content_type.partition(";")[0].strip().lower() == "application/json"


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """What the checks allow. Known hosts are always localhost (and `*.localhost`) and IP addresses;
    `allowed_hosts` adds names. With `check_host` off (a daemon bound to every interface, reached by
    names it cannot know) any Host is served, but a page is the daemon's own only under a known name."""

    allowed_hosts: tuple[str, ...] = ()
    check_host: bool = True
    allowed_origins: tuple[str, ...] = ()

    def is_known_host(self, name: str) -> bool:
        if name == "localhost" or name.endswith(".localhost") or _is_ip(name):
            return True
        return any(pattern == "*" or pattern == name or (pattern.startswith("*.") and name.endswith(pattern[1:]))
                   for pattern in self.allowed_hosts)

    def is_listed_origin(self, origin: str) -> bool:
        if "*" in self.allowed_origins:
            return True
        try:
            return normalize_origin(origin) in self.allowed_origins
        except ValueError:
            return False

    def is_own_origin(self, origin: str, host: str | None) -> bool:
        """Whether `origin` is the daemon's own as the request reached it: the same name and port as
        its Host (a Host without a port has the origin's scheme's), under a known name."""
        authority = split_authority(host) if host is not None else None
        scheme, sep, rest = origin.strip().lower().partition("://")
        theirs = split_authority(rest) if sep and scheme in DEFAULT_PORTS else None
        if authority is None or theirs is None or not self.is_known_host(authority[0]):
            return False
        port = authority[1] if authority[1] is not None else DEFAULT_PORTS[scheme]
        return theirs[0] == authority[0] and (theirs[1] or DEFAULT_PORTS[scheme]) == port

    def refusal(self, method: str, headers: Headers) -> RequestError | None:
        """The error a request gets at the edge, or None when it may go on to its route."""
        host = headers.get("host")
        if host is not None and self.check_host:
            authority = split_authority(host)
            if authority is None or not self.is_known_host(authority[0]):
                return RequestError(f"this server does not answer to the name {host[:200]!r}; localhost, IP "
                                    "addresses and the names in --allowed-hosts (FORGE_ALLOWED_HOSTS) reach it",
                                    status=421, code=HOST_NOT_ALLOWED)
        origin = headers.get("origin")
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if origin is not None and not self.is_listed_origin(origin) and (
                preflight or not self.is_own_origin(origin, host)):
            return RequestError(f"requests from pages at {origin[:200]!r} are not allowed; name the origin in "
                                "--allowed-origins (FORGE_ALLOWED_ORIGINS) to allow them", status=403,
                                type="permission_error", code=ORIGIN_NOT_ALLOWED)
        content_type = headers.get("content-type")
        if method not in BODILESS_METHODS and content_type is not None and not is_json(content_type):
            # A listed origin's page may read why (the CORS middleware, inside, never sees this request).
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin is not None else None
            return RequestError(f"the body must be JSON, sent with 'Content-Type: application/json' "
                                f"(this one came as {content_type[:100]!r})", status=415,
                                code="unsupported_media_type", headers=cors)
        return None


def policy_for(addr: str, *, allowed_hosts: str | None, allowed_origins: str | None) -> BrowserPolicy:
    """The policy of `forge serve`'s flags (comma-separated lists; ValueError naming a bad entry): Hosts
    checked unless the daemon listens on every interface and no --allowed-hosts is given; the name
    it listens on, if a name, is known."""
    try:
        hosts = parse_list(allowed_hosts, normalize_host)
    except ValueError as exc:
        raise ValueError(f"--allowed-hosts (FORGE_ALLOWED_HOSTS): {exc}") from None
    try:
        origins = parse_list(allowed_origins, normalize_origin)
    except ValueError as exc:
        raise ValueError(f"--allowed-origins (FORGE_ALLOWED_ORIGINS): {exc}") from None
    name = listen_name(addr)
    return BrowserPolicy(allowed_hosts=hosts + ((name,) if name else ()),
                         check_host=allowed_hosts is not None or not is_wildcard(addr), allowed_origins=origins)


class BrowserGuard:
    """ASGI middleware: each HTTP request checked against the policy before it reaches the routes;
    a refused one answered at once in its route's envelope and passed to `on_refused` (counting).
    Pure ASGI, so that streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy, on_refused: Callable[[RequestError], None]) -> None:
        self.app = app
        self.policy = policy
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.policy.refusal(scope["method"], Headers(scope=scope))
            if refusal is not None:
                self.on_refused(refusal)
                await error_response_for(scope["path"], refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)
