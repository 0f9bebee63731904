"""The dashboard page (GET /dashboard): one self-contained HTML file shipped in the package.

It fetches nothing from outside: its style and script are inline, and the content security policy
allows exactly those two (by their SHA-256) plus requests to its own origin, which is where it
polls GET /stats once a second. Read once per process.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources


@dataclass(frozen=True, slots=True)
class Page:
    html: bytes
    headers: dict[str, str]


def _digest(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@cache
def dashboard_page() -> Page:
    html = resources.files("actors.ops").joinpath("dashboard.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    styles = re.findall(r"<style>(.*?)</style>", html, flags=re.S)
    policy = "; ".join([
        "default-src 'none'",
        "script-src " + " ".join(_digest(s) for s in scripts),
        "style-src " + " ".join(_digest(s) for s in styles),
        "connect-src 'self'",
        "img-src data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])
    headers = {"Content-Security-Policy": policy, "Cache-Control": "no-cache",
               "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
    return Page(html.encode(), headers)
