"""Tenants at the edge: whose key a request carries, and the limits of that tenant (429 past them).

Without a tenant file the key check is today's: the one --api-key (or none), and no request has a tenant.
With one (actors/http/tenants.py), a request's key names its tenant (401 if none), and a response is let
in only while its tenant has fewer than max_concurrent in flight and a token in its bucket. The bucket
holds one minute of tokens_per_minute and refills continuously; a response's tokens (prompt + completion)
are taken when it ends, so a long one may leave the bucket below zero and the tenant waits them back.
Refused: 429 with Retry-After, counted by tenant and reason. The table is swapped whole on reload; the
counts of a tenant that stays carry over.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from actors.http.edge import check_key, presented_keys, unauthorized
from actors.http.tenants import Tenant, TenantTable
from actors.ops.metrics import Metrics
from forge.errors import RequestError

DEFAULT_TENANT = "default"        # the --api-key's tenant when a tenant file is given too
CONCURRENCY_RETRY_S = 1           # Retry-After past max_concurrent: a response may end any moment


class TokenBucket:
    """`per_minute` tokens a minute, refilled continuously up to one minute's worth; may go below zero."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self._at = now

    def refill(self, now: float) -> float:
        """The level now."""
        if now > self._at:
            self.level = min(float(self.per_minute), self.level + (now - self._at) * self.per_minute / 60)
            self._at = now
        return self.level

    def has_room(self, now: float) -> bool:
        return self.refill(now) >= 1

    def take(self, num_tokens: int, now: float) -> None:
        self.refill(now)
        self.level -= num_tokens

    def wait_s(self, now: float) -> float:
        """Seconds until the bucket holds a token again (0 when it does)."""
        return max(0.0, (1 - self.refill(now)) * 60 / self.per_minute)

    def resize(self, per_minute: int, now: float) -> None:
        """A new rate (a reload): the level carries over, at most the new minute's worth."""
        self.refill(now)
        self.per_minute = per_minute
        self.level = min(self.level, float(per_minute))


@dataclass(slots=True)
class TenantCounts:
    """One tenant's state at the edge: in flight now, its bucket, and its totals since start."""
    num_inflight: int = 0
    bucket: TokenBucket | None = None
    num_requests: int = 0
    num_rejected: dict[str, int] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0


class RateLimited(RequestError):
    """429: over the tenant's max_concurrent ("requests") or tokens_per_minute ("tokens")."""
    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, retry_after_s: int) -> None:
        super().__init__(message, type=kind, headers={"Retry-After": str(retry_after_s)})


class TenantGate:
    """Identifies a request's tenant and holds each tenant to its limits (see the module's docstring)."""

    def __init__(self, table: TenantTable | None, *, api_key: str | None, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`table`: the tenant file's (None: `api_key` alone, or no key); `metrics`: where the per-tenant
        counters go; `clock`: seconds, for the buckets."""
        self._api_key = api_key
        self._clock = clock
        self.table: TenantTable | None = None
        self.counts: dict[str, TenantCounts] = {}
        self._metrics = metrics
        self.reload(table, api_key=api_key)

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def reload(self, table: TenantTable | None, *, api_key: str | None) -> None:
        """Serve `table` and `api_key` from now on; a tenant that stays keeps its counts (its bucket at the
        new rate)."""
        self._api_key = api_key
        now = self._clock()
        tenants = dict(table.tenants) if table is not None else {}
        if table is not None and self._api_key is not None:
            tenants.setdefault(DEFAULT_TENANT, Tenant(name=DEFAULT_TENANT))
        for name in [n for n, c in self.counts.items() if n not in tenants and c.num_inflight == 0]:
            del self.counts[name]
        for tenant in tenants.values():
            counts = self.counts.setdefault(tenant.name, TenantCounts())
            if self._metrics is not None:        # each tenant's series from the first scrape, at zero
                self._metrics.tenant_requests.labels(tenant=tenant.name)
            if tenant.tokens_per_minute is None:
                counts.bucket = None
            elif counts.bucket is None:
                counts.bucket = TokenBucket(tenant.tokens_per_minute, now)
            else:
                counts.bucket.resize(tenant.tokens_per_minute, now)
        self.table = table
        self._tenants = tenants

    def identify(self, request: Request) -> Tenant | None:
        """The request's tenant (None without a tenant file), or 401 for a key no tenant holds."""
        table = self.table
        if table is None:
            check_key(request, self._api_key)
            return None
        found = None
        for key in presented_keys(request):
            tenant = table.find(key)
            if self._api_key is not None and hmac.compare_digest(key.encode(), self._api_key.encode()):
                tenant = self._tenants[DEFAULT_TENANT]
            found = found or tenant
        if found is None:
            raise unauthorized()              # the same 401 as a wrong --api-key
        return found

    def enter(self, tenant: Tenant) -> None:
        """One more response of `tenant` in flight, or RateLimited (429) past its limits."""
        counts = self.counts.setdefault(tenant.name, TenantCounts())
        now = self._clock()
        if tenant.max_concurrent is not None and counts.num_inflight >= tenant.max_concurrent:
            self._reject(tenant, counts, "max_concurrent")
            raise RateLimited(f"tenant '{tenant.name}' has {counts.num_inflight} requests in flight, its "
                              f"max_concurrent", kind="requests", retry_after_s=CONCURRENCY_RETRY_S)
        bucket = counts.bucket
        if bucket is not None and not bucket.has_room(now):
            self._reject(tenant, counts, "tokens_per_minute")
            raise RateLimited(f"tenant '{tenant.name}' has used its {bucket.per_minute} tokens per minute",
                              kind="tokens", retry_after_s=max(1, math.ceil(bucket.wait_s(now))))
        counts.num_inflight += 1
        counts.num_requests += 1
        if self._metrics is not None:
            self._metrics.tenant_requests.labels(tenant=tenant.name).inc()

    def leave(self, tenant: Tenant, num_prompt_tokens: int, num_completion_tokens: int) -> None:
        """A response of `tenant` has ended, having used these tokens (taken from its bucket)."""
        counts = self.counts.get(tenant.name)
        if counts is None:
            return
        counts.num_inflight -= 1
        counts.num_prompt_tokens += num_prompt_tokens
        counts.num_completion_tokens += num_completion_tokens
        if counts.bucket is not None:
            counts.bucket.take(num_prompt_tokens + num_completion_tokens, self._clock())
        if self._metrics is not None:
            self._metrics.tenant_tokens.labels(tenant=tenant.name, kind="prompt").inc(num_prompt_tokens)
            self._metrics.tenant_tokens.labels(tenant=tenant.name, kind="completion").inc(num_completion_tokens)

    def _reject(self, tenant: Tenant, counts: TenantCounts, reason: str) -> None:
        counts.num_rejected[reason] = counts.num_rejected.get(reason, 0) + 1
        if self._metrics is not None:
            self._metrics.tenant_rejected.labels(tenant=tenant.name, reason=reason).inc()

    def statistics(self) -> list[dict[str, Any]]:
        """Each tenant of the table now: its settings and counts (plain JSON types), for /stats."""
        now = self._clock()
        out = []
        for name, tenant in self._tenants.items():
            counts = self.counts.get(name, TenantCounts())
            bucket = counts.bucket
            out.append({"name": name, "priority": tenant.priority, "share": tenant.share,
                        "max_concurrent": tenant.max_concurrent, "tokens_per_minute": tenant.tokens_per_minute,
                        "inflight": counts.num_inflight, "requests": counts.num_requests,
                        "rejected": dict(counts.num_rejected), "prompt_tokens": counts.num_prompt_tokens,
                        "completion_tokens": counts.num_completion_tokens,
                        "tokens_left": round(bucket.refill(now), 1) if bucket is not None else None})
        return out
