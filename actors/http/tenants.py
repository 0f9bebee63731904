"""The tenant table (--api-keys-file): who a request's key belongs to, and what that tenant may do.

A TOML file of `[[tenant]]` tables, each with `name`, `key` (or `key_sha256`, the hex SHA-256 of the key,
so that the file need hold no secret), `priority` (an int, lower is more urgent, as vLLM's), `share`
(its weight when tenants take turns, default 1), `max_concurrent` (responses in flight) and
`tokens_per_minute` (prompt + completion tokens). The whole file is checked before it is used: the first
fault is one TenantFileError naming the tenant and the field. Keys are compared as SHA-256 digests, each
against every tenant's in constant time. Nothing here counts or limits: actors/http/tenant_limits.py does.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from dataclasses import dataclass
from typing import Any

FIELDS = ("name", "key", "key_sha256", "priority", "share", "max_concurrent", "tokens_per_minute")
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")       # a metric label and a log field: plain and short
_HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_PRIORITY = 2**31 - 1                              # the request field's range (forge.api.openai.openai_schema)


class TenantFileError(ValueError):
    """The tenant file cannot be used; the message is one line naming the file, the tenant and the field."""


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    key_sha256: bytes = b""                 # the key's SHA-256 digest (32 bytes)
    priority: int = 0                       # the most urgent priority its requests may have
    share: float = 1.0                      # its weight among tenants of one priority
    max_concurrent: int | None = None       # responses in flight at once; None: no limit
    tokens_per_minute: int | None = None    # prompt + completion tokens a minute; None: no limit


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class TenantTable:
    """The tenants of one reading of the file, found by key."""

    def __init__(self, tenants: list[Tenant], *, source: str = "") -> None:
        self.tenants = {t.name: t for t in tenants}
        self.source = source

    def find(self, key: str) -> Tenant | None:
        """The tenant whose key this is, or None. Every tenant's digest is compared, each in constant time,
        so the time taken says nothing about which (or whether one) matched."""
        given = digest(key)
        found = None
        for tenant in self.tenants.values():
            if hmac.compare_digest(given, tenant.key_sha256):
                found = tenant
        return found

    def __len__(self) -> int:
        return len(self.tenants)


def load_tenants(path: str) -> TenantTable:
    """The table in the file at `path`; TenantFileError (one line) if it cannot be read or used."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise TenantFileError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise TenantFileError(f"--api-keys-file {path}: not valid TOML: {exc}") from None
    return parse_tenants(data, source=path)


def parse_tenants(data: dict[str, Any], *, source: str = "") -> TenantTable:
    """The table of a decoded file (see the module's docstring); TenantFileError names the first fault."""
    where = f"--api-keys-file {source}" if source else "--api-keys-file"
    unknown = [k for k in data if k != "tenant"]
    if unknown:
        raise TenantFileError(f"{where}: unknown top-level entry '{unknown[0]}' (the file holds [[tenant]] tables)")
    entries = data.get("tenant")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise TenantFileError(f"{where}: no [[tenant]] table (each tenant is one [[tenant]] table)")
    tenants: list[Tenant] = []
    seen_keys: dict[bytes, str] = {}
    for i, entry in enumerate(entries, start=1):
        tenant = _tenant(entry, f"{where}: tenant {i}")
        if tenant.name in {t.name for t in tenants}:
            raise TenantFileError(f"{where}: tenant {i}: name '{tenant.name}' is used by another tenant")
        if tenant.key_sha256 in seen_keys:
            raise TenantFileError(f"{where}: tenant {i} ('{tenant.name}'): key is also tenant "
                                  f"'{seen_keys[tenant.key_sha256]}''s")
        seen_keys[tenant.key_sha256] = tenant.name
        tenants.append(tenant)
    return TenantTable(tenants, source=source)


def _tenant(entry: dict[str, Any], where: str) -> Tenant:
    name = entry.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise TenantFileError(f"{where}: name must be 1-64 letters, digits or _.@-, got {name!r}")
    where = f"{where} ('{name}')"
    for field in entry:
        if field not in FIELDS:
            raise TenantFileError(f"{where}: unknown field '{field}' (fields: {', '.join(FIELDS)})")
    key, key_hash = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (key_hash is None):
        raise TenantFileError(f"{where}: key or key_sha256 must be given (one of them)")
    if key is not None and (not isinstance(key, str) or len(key) < 8):
        raise TenantFileError(f"{where}: key must be a string of at least 8 characters")
    if key_hash is not None and (not isinstance(key_hash, str) or not _HEX_SHA256.match(key_hash.lower())):
        raise TenantFileError(f"{where}: key_sha256 must be 64 hex digits (sha256sum of the key)")
    priority = entry.get("priority", 0)
    if not _is_int(priority) or abs(priority) > MAX_PRIORITY:
        raise TenantFileError(f"{where}: priority must be an integer within +-{MAX_PRIORITY}, got {priority!r}")
    share = entry.get("share", 1)
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1e6:
        raise TenantFileError(f"{where}: share must be a number above 0 (at most 1e6), got {share!r}")
    limits = {}
    for field in ("max_concurrent", "tokens_per_minute"):
        value = entry.get(field)
        if value is not None and (not _is_int(value) or value < 1):
            raise TenantFileError(f"{where}: {field} must be a positive integer, got {value!r}")
        limits[field] = value
    key_sha256 = digest(key) if isinstance(key, str) else bytes.fromhex(str(key_hash).lower())
    return Tenant(name=name, key_sha256=key_sha256,
                  priority=priority, share=float(share), **limits)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
