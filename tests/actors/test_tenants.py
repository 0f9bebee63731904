"""The tenant file and the limits at the edge: the file is checked field by field (one error naming the
tenant and the field), keys are found by digest, the token bucket refills at its rate and may go below
zero, and the gate refuses past max_concurrent and an empty bucket with the right Retry-After."""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import pytest

from actors.http.tenant_limits import RateLimited, TenantGate, TokenBucket
from actors.http.tenants import Tenant, TenantFileError, load_tenants, parse_tenants

BATCH_SHA256 = hashlib.sha256(b"batch-key-0002").hexdigest()
GOOD = f"""
[[tenant]]
name = "web"
key = "web-key-0001"
priority = 0
share = 2
max_concurrent = 4
tokens_per_minute = 6000

[[tenant]]
name = "batch"
key_sha256 = "{BATCH_SHA256}"
priority = 10
"""


def test_a_good_file_finds_each_tenant_by_its_key_or_its_keys_digest(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(GOOD)
    table = load_tenants(str(path))
    web, batch = table.find("web-key-0001"), table.find("batch-key-0002")
    assert web is not None and web.name == "web" and web.share == 2.0 and web.max_concurrent == 4
    assert web.tokens_per_minute == 6000 and web.priority == 0
    assert batch is not None and batch.name == "batch" and batch.priority == 10 and batch.share == 1.0
    assert batch.max_concurrent is None and batch.tokens_per_minute is None
    for wrong in ("", "web-key-000", "web-key-00011", "WEB-KEY-0001", hashlib.sha256(b"batch-key-0002").hexdigest()):
        assert table.find(wrong) is None


@pytest.mark.parametrize(("text", "names"), [
    ("", "no [[tenant]] table"),
    ("[[tenant]]\nkey = 'abcdefgh1'", "tenant 1: name"),
    ("[[tenant]]\nname = 'a b'\nkey = 'abcdefgh1'", "tenant 1: name"),
    ("[[tenant]]\nname = 'a'", "('a'): key or key_sha256"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\nkey_sha256 = '%s'" % ("0" * 64), "('a'): key or key_sha256"),
    ("[[tenant]]\nname = 'a'\nkey = 'short'", "('a'): key must be"),
    ("[[tenant]]\nname = 'a'\nkey_sha256 = 'abc'", "('a'): key_sha256 must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\npriority = 'high'", "('a'): priority must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\npriority = 1.5", "('a'): priority must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\nshare = 0", "('a'): share must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\nshare = true", "('a'): share must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\nmax_concurrent = 0", "('a'): max_concurrent must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\ntokens_per_minute = -5", "('a'): tokens_per_minute must be"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\nmax_concurent = 3", "('a'): unknown field 'max_concurent'"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\n[[tenant]]\nname = 'a'\nkey = 'abcdefgh2'", "tenant 2: name 'a'"),
    ("[[tenant]]\nname = 'a'\nkey = 'abcdefgh1'\n[[tenant]]\nname = 'b'\nkey = 'abcdefgh1'", "tenant 2 ('b'): key"),
    ("[server]\nx = 1", "unknown top-level entry 'server'"),
])
def test_a_bad_file_is_one_line_naming_the_tenant_and_the_field(text: str, names: str) -> None:
    with pytest.raises(TenantFileError) as caught:
        parse_tenants(tomllib.loads(text), source="keys.toml")
    message = str(caught.value)
    assert names in message and "keys.toml" in message and "\n" not in message


def test_an_unreadable_or_malformed_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TenantFileError, match="missing.toml"):
        load_tenants(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[[tenant]\nname = ")
    with pytest.raises(TenantFileError, match="not valid TOML"):
        load_tenants(str(bad))


def test_the_bucket_refills_at_its_rate_up_to_one_minute_and_may_go_below_zero() -> None:
    bucket = TokenBucket(600, now=0.0)            # 10 tokens a second
    assert bucket.has_room(0.0) and bucket.refill(0.0) == 600
    bucket.take(1000, now=0.0)
    assert bucket.refill(0.0) == -400 and not bucket.has_room(0.0)
    assert bucket.wait_s(0.0) == pytest.approx(40.1)          # to one token: 401 tokens at 10/s
    assert bucket.refill(30.0) == pytest.approx(-100) and not bucket.has_room(30.0)
    assert bucket.has_room(40.1)
    assert bucket.refill(1000.0) == 600                        # never more than a minute's worth
    bucket.resize(60, now=1000.0)
    assert bucket.refill(1000.0) == 60 and bucket.wait_s(1000.0) == 0


def test_the_gate_refuses_past_max_concurrent_and_an_empty_bucket_then_lets_in_again() -> None:
    now = [0.0]
    tenant = Tenant(name="t", key_sha256=hashlib.sha256(b"k").digest(), max_concurrent=2, tokens_per_minute=60)
    gate = TenantGate(parse_tenants({"tenant": [{"name": "t", "key": "tenant-key", "max_concurrent": 2,
                                                  "tokens_per_minute": 60}]}), api_key=None, clock=lambda: now[0])
    gate.enter(tenant)
    gate.enter(tenant)
    with pytest.raises(RateLimited) as caught:
        gate.enter(tenant)
    assert caught.value.status == 429 and caught.value.type == "requests"
    assert caught.value.code == "rate_limit_exceeded" and caught.value.headers["Retry-After"] == "1"
    gate.leave(tenant, 50, 70)                  # 120 tokens: the bucket (60) is 60 below zero
    with pytest.raises(RateLimited) as caught:
        gate.enter(tenant)
    assert caught.value.type == "tokens" and caught.value.headers["Retry-After"] == "61"   # 61 tokens at 1/s
    now[0] = 61.0
    gate.enter(tenant)
    stats = {s["name"]: s for s in gate.statistics()}
    assert stats["t"]["inflight"] == 2 and stats["t"]["requests"] == 3
    assert stats["t"]["rejected"] == {"max_concurrent": 1, "tokens_per_minute": 1}
    assert stats["t"]["prompt_tokens"] == 50 and stats["t"]["completion_tokens"] == 70


def test_a_reload_keeps_the_counts_of_a_tenant_that_stays_and_drops_one_removed_when_idle() -> None:
    two = [{"name": "a", "key": "a-key-0001"}, {"name": "b", "key": "b-key-0001"}]
    gate = TenantGate(parse_tenants({"tenant": two}), api_key=None)
    a = gate.table.find("a-key-0001") if gate.table is not None else None
    assert a is not None
    gate.enter(a)
    gate.reload(parse_tenants({"tenant": [{"name": "c", "key": "c-key-0001"}]}), api_key=None)
    assert gate.counts["a"].num_inflight == 1 and "b" not in gate.counts      # a: still in flight
    assert [s["name"] for s in gate.statistics()] == ["c"]
    gate.leave(a, 1, 1)
    assert gate.counts["a"].num_inflight == 0
