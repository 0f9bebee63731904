"""The prefix cache's disk tier (--kv-cache-dir) as an operator sees it: a prompt served, the daemon stopped,
and a new daemon on the same directory finds the prompt's blocks on disk (cached_tokens) and answers exactly
as the cold one did; corrupt and truncated files, another layout's directory, RAM evictions within one
daemon, a directory it cannot use and a directory another daemon holds, each with the same answers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import httpx

from actors.supervisor import running_daemon
from tests.integration.harness import HANG_GUARD_S, SERVED_MODEL, MakeDaemon, forge_serve, scraped, wait_healthy

# ~330 tokens: twenty full blocks and a partial one
SHARED = ("The lighthouse on Gull Rock was built in 1871 by the harbour board. Its lamp burned paraffin until "
          "1934, when an electric lamp replaced it. The keeper, Thomas Reed, kept a log of every ship that "
          "passed, and his daughter Mary rowed out to rescue the crew of the schooner Alba in the storm of 1889. ")
PROMPT = SHARED * 4 + "Question: who rowed out in the storm? Answer:"


def body(prompt: str = PROMPT) -> dict[str, Any]:
    return {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}


async def ask(http: httpx.AsyncClient, prompt: str = PROMPT) -> tuple[str, int]:
    """(text, cached_tokens) of a greedy completion."""
    reply = await http.post("/v1/completions", json=body(prompt))
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def block_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kvb"))


async def serve_once(make_daemon: MakeDaemon, root: Path, prompt: str = PROMPT, **engine: Any) -> tuple[str, int, str]:
    """One daemon on `root`: the prompt's (text, cached_tokens) and its /metrics, then stopped (drained)."""
    async with running_daemon(make_daemon(kv_cache_dir=str(root), **engine)) as url, \
            httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
        text, cached = await ask(http, prompt)
        metrics = (await http.get("/metrics")).text
    return text, cached, metrics


async def test_a_restarted_daemon_finds_the_prompt_on_disk(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with anyio.fail_after(2 * HANG_GUARD_S):
        cold, cold_cached, _ = await serve_once(make_daemon, root)
        written = block_files(root)
        warm, warm_cached, metrics = await serve_once(make_daemon, root)
    assert cold_cached == 0
    assert len(written) >= 20, "the drain writes the cached prompt blocks out"
    assert warm == cold
    assert warm_cached >= 20 * 16
    assert scraped(metrics, "forge:kv_disk_hit_blocks_total", model_name=SERVED_MODEL) >= 20
    assert scraped(metrics, "forge:kv_disk_read_bytes_total", model_name=SERVED_MODEL) > 0
    assert scraped(metrics, "forge:kv_disk_blocks", model_name=SERVED_MODEL) >= 20


async def test_corrupt_and_truncated_files_are_misses(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with anyio.fail_after(2 * HANG_GUARD_S):
        cold, _, _ = await serve_once(make_daemon, root)
        files = block_files(root)
        for path in files[::2]:                      # a flipped byte in the payload
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        for path in files[1::4]:                     # a torn write
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 3)
        again, _, metrics = await serve_once(make_daemon, root)
    assert again == cold
    assert scraped(metrics, "forge:kv_disk_bad_files_total", model_name=SERVED_MODEL) >= 1 or \
        scraped(metrics, "forge:kv_disk_hit_blocks_total", model_name=SERVED_MODEL) == 0


async def test_another_layouts_directory_is_never_read(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with anyio.fail_after(2 * HANG_GUARD_S):
        await serve_once(make_daemon, root, kv_cache_dtype="float32")
        theirs = block_files(root)
        _, cached, metrics = await serve_once(make_daemon, root)      # float16: another fingerprint
    assert theirs and cached == 0
    assert scraped(metrics, "forge:kv_disk_hit_blocks_total", model_name=SERVED_MODEL) == 0
    assert all(p.exists() for p in theirs), "another layout's files are left alone"
    assert len({p.parent for p in block_files(root)}) == 2


async def test_blocks_evicted_from_ram_come_back_from_disk(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    # 64 blocks of RAM (the 1024-token context): the prompt (21 blocks), then five others (21 each) push it out
    others = [f"Story {n}: " + SHARED.replace("Gull Rock", f"Rock {n}") * 4 for n in range(5)]
    with anyio.fail_after(2 * HANG_GUARD_S):
        async with running_daemon(make_daemon(kv_cache_dir=str(root), kv_cache_memory=64 * 368640)) as url, \
                httpx.AsyncClient(base_url=url, timeout=HANG_GUARD_S) as http:
            first, _ = await ask(http)
            for other in others:
                await ask(http, other)
            while scraped((await http.get("/metrics")).text, "forge:kv_disk_blocks", model_name=SERVED_MODEL) < 40:
                await anyio.sleep(0.05)              # the writer thread is behind the evictions
            again, cached = await ask(http)
            metrics = (await http.get("/metrics")).text
    assert again == first
    assert cached >= 16
    assert scraped(metrics, "forge:kv_disk_hit_blocks_total", model_name=SERVED_MODEL) >= 1
    assert scraped(metrics, "forge:kv_disk_written_bytes_total", model_name=SERVED_MODEL) > 0


async def test_a_directory_held_by_another_daemon_is_refused(make_daemon: MakeDaemon, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with anyio.fail_after(2 * HANG_GUARD_S):
        first = make_daemon(kv_cache_dir=str(root))
        second = make_daemon(kv_cache_dir=str(root))
        async with running_daemon(first) as url_a, running_daemon(second) as url_b, \
                httpx.AsyncClient(timeout=HANG_GUARD_S) as http:
            assert first.allocator is not None and first.allocator.tier is not None
            assert second.allocator is not None and second.allocator.tier is None
            text_a = (await http.post(f"{url_a}/v1/completions", json=body())).json()["choices"][0]["text"]
            text_b = (await http.post(f"{url_b}/v1/completions", json=body())).json()["choices"][0]["text"]
    assert text_a == text_b


async def test_an_unusable_directory_is_one_warning_and_serving_goes_on(tmp_path: Path,
                                                                        default_model_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    args = ["--model", str(default_model_path), "--kv-cache-dir", str(not_a_dir / "kv"),
            "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--served-model-name", SERVED_MODEL]
    with anyio.fail_after(HANG_GUARD_S):
        async with forge_serve(tmp_path, args, forge_home=tmp_path / "home") as (proc, port, log), \
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
            await wait_healthy(http, proc, log.read_text)
            text, _ = await ask(http)
            proc.terminate()
            await proc.wait()
    lines = [line for line in log.read_text().splitlines() if "K/V disk tier is off" in line]
    assert len(lines) == 1 and "file" in lines[0]
    assert text and proc.returncode == 0
    assert not os.path.exists(not_a_dir / "kv")
