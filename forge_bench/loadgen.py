"""A load generator for any OpenAI-compatible server: `forge bench serve`.

It streams `/v1/completions` with a seeded workload of mixed prompt lengths (some sharing a long
prefix, some asking to repeat their input), at closed-loop concurrency levels or at an open-loop
Poisson rate, and reports output tokens/s, requests/s, TTFT, TPOT, inter-token latency,
end-to-end latency, errors and goodput. Figures only: nothing here judges them.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx
import numpy as np

_WORDS = ("the river city light market winter garden story people music water table mountain "
          "school letter evening window travel morning paper friend number history system "
          "animal forest bridge kitchen village question answer family problem power season "
          "science ocean planet silver quiet bright small ancient modern simple careful open "
          "carry build follow remember change explain imagine gather measure notice wander").split()


@dataclass(slots=True)
class WorkItem:
    prompt: str
    kind: str                 # one of WORKLOAD_KINDS
    num_prompt_tokens: int


@dataclass(slots=True)
class Workload:
    items: list[WorkItem]
    max_tokens: int


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _text_of_tokens(tokenizer: Any, rng: random.Random, num_tokens: int) -> str:
    ids = tokenizer.encode(_words(rng, num_tokens + 8), add_special_tokens=False)[:num_tokens]
    return str(tokenizer.decode(ids))


WORKLOAD_KINDS = ("open", "shared-prefix", "grounded", "task")


def _stdlib_sources() -> tuple[list[str], list[str]]:
    """Real code and prose that every Python installation has: functions of a few standard modules, and
    their modules' docstrings (paragraphs). Deterministic for one Python version."""
    import argparse
    import inspect
    import textwrap
    functions = (textwrap.wrap, textwrap.dedent, textwrap.indent, textwrap.TextWrapper._wrap_chunks,
                 argparse.ArgumentParser.parse_known_args, inspect.getsource, inspect.getmembers)
    code = [inspect.getsource(fn) for fn in functions]
    prose = [p.strip() for doc in (argparse.__doc__, inspect.__doc__, textwrap.TextWrapper.__doc__, json.__doc__)
             for p in (doc or "").split("\n\n") if len(p.strip()) > 80]
    return code, prose


def _task(tokenizer: Any, rng: random.Random, code: list[str], prose: list[str], lo: int, hi: int) -> str:
    """Input-grounded work of lo..hi prompt tokens: rewrite code with one change, quote a sentence, or
    summarise with quotes. The answer repeats much of the input."""
    def clip(text: str) -> str:
        ids = tokenizer.encode(text, add_special_tokens=False)[: rng.randint(lo, hi)]
        return str(tokenizer.decode(ids))
    choice = rng.randrange(3)
    if choice == 0:
        source = clip(rng.choice(code))
        return f"Code:\n{source}\n\nRewrite the code above with every variable named `i` renamed to `k`, changing " \
               f"nothing else.\n\nRewritten code:\n"
    passage = clip(" ".join(rng.sample(prose, k=min(len(prose), 4))))
    if choice == 1:
        return f"Text:\n{passage}\n\nQuote, word for word, the sentences of the text that mention a file.\n\nQuotes:\n"
    return f"Text:\n{passage}\n\nSummarise the text, quoting its own words wherever you can.\n\nSummary:\n"


def build_workload(tokenizer: Any, *, num_requests: int, max_tokens: int = 128, seed: int = 0,
                   min_len: int = 20, max_len: int = 1000, kinds: Sequence[str] = ("open", "shared-prefix",
                                                                                     "grounded")) -> Workload:
    """A seeded mix: open-ended prompts of log-uniform length, prompts sharing one long prefix,
    input-grounded prompts (repeat a passage of random words), and "task" prompts of 300-600 tokens
    (rewrite real code with one change, quote or summarise real prose). Lengths are in the model's
    own tokens."""
    rng = random.Random(seed)
    prefix = "You are a helpful assistant. Background notes: " + _text_of_tokens(tokenizer, rng, min(600, max_len // 2))
    code, prose = _stdlib_sources() if "task" in kinds else ([], [])
    items = []
    for i in range(num_requests):
        kind = kinds[i % len(kinds)]
        length = int(round(np.exp(rng.uniform(np.log(min_len), np.log(max_len)))))
        if kind == "open":
            prompt = _text_of_tokens(tokenizer, rng, length) + "\nContinue the story:"
        elif kind == "shared-prefix":
            prompt = prefix + "\nQuestion: " + _words(rng, rng.randint(5, 30)) + "?\nAnswer:"
        elif kind == "task":
            prompt = _task(tokenizer, rng, code, prose, 300, 560)
        else:
            passage = _text_of_tokens(tokenizer, rng, max(10, length // 2))
            prompt = f"Passage:\n{passage}\n\nRepeat the passage word for word.\nPassage:\n"
        items.append(WorkItem(prompt, kind, len(tokenizer.encode(prompt, add_special_tokens=False))))
    return Workload(items, max_tokens)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    kind: str
    num_prompt_tokens: int
    num_output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


async def _one(client: httpx.AsyncClient, model: str | None, item: WorkItem, max_tokens: int,
               extra: dict[str, Any]) -> RequestResult:
    """One streamed request. A keep-alive connection the server closed while idle is retried once
    on a fresh connection: that is the client's artefact, not a failure of the server."""
    res = await _attempt(client, model, item, max_tokens, extra)
    if res.error is not None and res.error.startswith("RemoteProtocolError") and res.ttft_s is None:
        res = await _attempt(client, model, item, max_tokens, extra)
    return res


async def _attempt(client: httpx.AsyncClient, model: str | None, item: WorkItem, max_tokens: int,
                   extra: dict[str, Any]) -> RequestResult:
    body: dict[str, Any] = {"prompt": item.prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
                            **extra}
    if model:
        body["model"] = model
    res = RequestResult(ok=False, kind=item.kind, num_prompt_tokens=item.num_prompt_tokens)
    start = time.perf_counter()
    last = start
    num_chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.num_output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    num_chunks += 1
        res.num_output_tokens = res.num_output_tokens or num_chunks
        res.ok = res.ttft_s is not None
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.e2e_s = time.perf_counter() - start
    return res


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if len(values) else None


def summarize(results: list[RequestResult], wall_s: float, *, ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [(r.e2e_s - (r.ttft_s or 0)) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    itl = [x for r in ok for x in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    good = [r for r in ok if (r.ttft_s or 0) <= ttft_slo and (r.num_output_tokens <= 1 or
            (r.e2e_s - (r.ttft_s or 0)) / (r.num_output_tokens - 1) <= tpot_slo)]
    out_tokens = sum(r.num_output_tokens for r in ok)
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if not r.ok), None),
        "wall_s": round(wall_s, 3),
        "output_tok_s": round(out_tokens / wall_s, 2) if wall_s else None,
        "prompt_tok_s": round(sum(r.num_prompt_tokens for r in ok) / wall_s, 2) if wall_s else None,
        "req_s": round(len(ok) / wall_s, 4) if wall_s else None,
        "ttft_p50": _pct(ttft, 50), "ttft_p90": _pct(ttft, 90), "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50), "tpot_p90": _pct(tpot, 90), "tpot_p99": _pct(tpot, 99),
        "itl_p50": _pct(itl, 50), "itl_p90": _pct(itl, 90), "itl_p99": _pct(itl, 99),
        "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99),
        "goodput_req_s": round(len(good) / wall_s, 4) if wall_s else None,
        "goodput_share": round(len(good) / len(results), 4) if results else None,
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
    }


class _Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.done, self.enabled = label, total, 0, enabled

    def tick(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // max(1, self.total)
            print(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}",
                  end="" if self.done < self.total else "\n", file=sys.stderr, flush=True)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def level_items(workload: Workload, first: int, count: int) -> list[WorkItem]:
    """Items first .. first + count of the workload, wrapping around its end."""
    return [workload.items[(first + i) % len(workload.items)] for i in range(count)]


async def run_closed_loop(base_url: str, workload: Workload, concurrency: int, num_requests: int, *,
                          model: str | None = None, extra: dict[str, Any] | None = None,
                          progress: bool = True, timeout_s: float = 1800,
                          api_key: str | None = None, first: int = 0) -> tuple[list[RequestResult], float]:
    """`concurrency` clients each send their next request as soon as the previous one ends: the
    workload's items from `first` on (wrapping)."""
    items = level_items(workload, first, num_requests)
    results: list[RequestResult] = []
    bar = _Progress(f"c={concurrency}", num_requests, progress)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits,
                                 headers=_auth(api_key)) as client:
        queue = list(reversed(items))

        async def worker() -> None:
            while queue:
                item = queue.pop()
                results.append(await _one(client, model, item, workload.max_tokens, extra or {}))
                bar.tick()

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker)
        return results, time.perf_counter() - start


async def run_open_loop(base_url: str, workload: Workload, rate: float, num_requests: int, *, seed: int = 0,
                        model: str | None = None, extra: dict[str, Any] | None = None,
                        progress: bool = True, timeout_s: float = 1800,
                        api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Poisson arrivals at `rate` requests/s, whatever the server's pace."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, num_requests)
    results: list[RequestResult] = []
    bar = _Progress(f"rate={rate}/s", num_requests, progress)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, headers=_auth(api_key),
                                 limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, gap in enumerate(gaps):
                await anyio.sleep(float(gap))
                item = workload.items[i % len(workload.items)]

                async def fire(item: WorkItem = item) -> None:
                    results.append(await _one(client, model, item, workload.max_tokens, extra or {}))
                    bar.tick()

                tg.start_soon(fire)
        return results, time.perf_counter() - start


def plot(levels: list[dict[str, Any]], path: str) -> None:
    """Throughput and latency against concurrency, as a PNG (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("forge: --plot needs matplotlib (pip install 'forge[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server in sorted({lv["server"] for lv in levels}):
        rows = sorted((lv for lv in levels if lv["server"] == server), key=lambda lv: lv["concurrency"])
        xs = [lv["concurrency"] for lv in rows]
        a.plot(xs, [lv["output_tok_s"] for lv in rows], marker="o", label=server)
        b.plot(xs, [lv["ttft_p50"] for lv in rows], marker="o", label=f"{server} TTFT p50")
        b.plot(xs, [lv["tpot_p50"] for lv in rows], marker="x", linestyle="--", label=f"{server} TPOT p50")
    a.set(xlabel="concurrent streams", ylabel="output tokens/s", xscale="log", title="throughput")
    b.set(xlabel="concurrent streams", ylabel="seconds", xscale="log", yscale="log", title="latency")
    a.legend()
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def level_record(server: str, concurrency: int, results: list[RequestResult], wall_s: float,
                 ttft_slo: float, tpot_slo: float) -> dict[str, Any]:
    rec = {"server": server, "concurrency": concurrency}
    rec.update(summarize(results, wall_s, ttft_slo=ttft_slo, tpot_slo=tpot_slo))
    kinds = sorted({r.kind for r in results})
    rec["by_kind"] = {k: summarize([r for r in results if r.kind == k], wall_s, ttft_slo=ttft_slo,
                                   tpot_slo=tpot_slo) for k in kinds}
    return rec


__all__ = ["Workload", "WorkItem", "RequestResult", "build_workload", "level_items", "run_closed_loop", "run_open_loop",
           "summarize", "plot", "level_record", "asdict"]
