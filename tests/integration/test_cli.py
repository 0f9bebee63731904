"""The installed command: a bad model is one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.integration.harness import HANG_GUARD_S, forge_serve, wait_healthy
from tests.tiny_gguf import write_tiny_llama


def forge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actors", *args], capture_output=True, text=True, timeout=120)


def test_serve_with_a_corrupt_model_says_so_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model" * 100)
    result = forge("serve", "--model", str(bad), "--addr", "127.0.0.1:0", "--log-format", "json")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "bad.gguf" in result.stderr.strip().splitlines()[-1]


def test_serve_on_a_port_in_use_says_so_and_exits_2() -> None:
    """Another server on the address: one line naming it and the flag, not a crash report."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        result = forge("serve", "--addr", addr, "--kv-cache-commit", "off", "--log-format", "json")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "daemon_crashed" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"forge: cannot listen on {addr}") and "in use" in last


def test_generate_with_a_missing_model_says_so_and_exits_2(tmp_path: Path) -> None:
    result = forge("generate", "hello", "--model", str(tmp_path / "absent.gguf"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "not found" in result.stderr


def test_generate_streams_only_the_completion_to_stdout() -> None:
    result = forge("generate", "The capital of France is", "--max-tokens", "4", "--blas-threads", "1")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "forge:" not in result.stdout


def test_a_draft_model_that_speaks_another_vocabulary_is_refused(gemma3_model_path: Path) -> None:
    result = forge("generate", "hello", "--draft-model", str(gemma3_model_path), "--max-tokens", "2")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "does not share" in result.stderr and "vocabulary" in result.stderr


def test_naming_a_draft_turns_draft_speculation_on() -> None:
    result = forge("generate", "The capital of France is", "--max-tokens", "4", "--blas-threads", "1",
                   "--draft-layers", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    bad = forge("generate", "hello", "--speculative", "ngram", "--draft-layers", "4")
    assert bad.returncode != 0 and "go with --speculative draft" in bad.stderr


def test_amx_kernels_where_they_cannot_run_are_refused_in_one_line() -> None:
    """Without the compiled kernels (as on a host with no compiler, or a CPU without AMX) --kernels
    amx exits 2 saying why, and auto falls back to onnxruntime and answers."""
    env = {**os.environ, "FORGE_NO_COMPILED_KERNELS": "1"}
    refused = subprocess.run([sys.executable, "-m", "actors", "generate", "hello", "--kernels", "amx"],
                             capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and refused.stdout == ""
    assert "AMX" in refused.stderr.strip().splitlines()[-1]
    fallback = subprocess.run([sys.executable, "-m", "actors", "generate", "The capital of France is", "--max-tokens",
                               "4", "--temperature", "0"], capture_output=True, text=True, timeout=120, env=env)
    assert fallback.returncode == 0, fallback.stderr
    assert "Paris" in fallback.stdout


def test_kv_events_on_a_port_in_use_say_so_and_exit_2() -> None:
    """The KV-event socket is bound before the model loads: a port in use is one line naming the flag."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        result = forge("serve", "--addr", "127.0.0.1:0", "--kv-events", "--kv-events-endpoint", endpoint,
                       "--log-format", "json")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"forge: cannot bind the KV-event socket to {endpoint}") and "--kv-events-endpoint" in last


def test_kv_events_with_several_models_are_refused_in_one_line(default_model_path: Path) -> None:
    """One KV-event socket publishes one prefix cache, so --kv-events serves one model."""
    result = forge("serve", "--addr", "127.0.0.1:0", "--model", f"a={default_model_path}",
                   "--model", f"b={default_model_path}", "--kv-events", "--kv-events-endpoint", "tcp://127.0.0.1:*",
                   "--log-format", "json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == "forge: --kv-events publishes one prefix cache: serve one model with it"


@pytest.mark.parametrize("kwargs", [{"metadata": {"context_length": 2**40}}, {"metadata": {"context_length": 10**8}},
                                    {"one_row_short": ("token_embd.weight",), "quant": "Q8_0", "hidden": 64,
                                     "heads": 8}],
                         ids=["context 2^40", "context 1e8", "a quantized embedding one row short"])
def test_serve_with_a_file_whose_metadata_claims_too_much_says_so_and_exits_2(tmp_path: Path,
                                                                               kwargs: dict[str, Any]) -> None:
    """The file's metadata checked against sane bounds and its tensors before anything is sized by it (the
    RoPE tables were built for the file's context: 8 TiB at 2^40, 25 GiB at 1e8)."""
    bad = write_tiny_llama(tmp_path / "claims.gguf", readable_tokenizer=True, **kwargs)
    result = forge("serve", "--model", str(bad), "--addr", "127.0.0.1:0", "--max-model-len", "128")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "claims.gguf: " in result.stderr.strip().splitlines()[-1]


async def test_models_dir_files_whose_names_hold_an_equals_sign_are_paths(tmp_path: Path,
                                                                          default_model_path: Path) -> None:
    """`--models-dir` with "v=2.gguf" beside "plain.gguf": each served under its file's name ("v=2" was read as
    the id "v" of a file "2.gguf", which was not found: exit 2). A --model value that is an existing file is a
    path too; one that is not is ID=MODEL."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("v=2.gguf", "plain.gguf"):
        (models / name).symlink_to(default_model_path)
    (tmp_path / "a=b.gguf").symlink_to(default_model_path)
    args = ["--models-dir", str(models), "--model", str(tmp_path / "a=b.gguf"), "--model", f"x={default_model_path}",
            "--kv-cache-memory", "64MiB", "--kv-cache-commit", "off"]
    async with forge_serve(tmp_path, args, forge_home=tmp_path / "home") as (proc, port, log):
        with anyio.fail_after(2 * HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, lambda: log.read_text()[-4000:], interval=0.2)
                ids = {m["id"] for m in (await http.get("/v1/models")).json()["data"]}
                served = await http.post("/v1/completions", json={"model": "v=2", "prompt": "Hi", "max_tokens": 2})
            proc.send_signal(signal.SIGTERM)
            assert await proc.wait() == 0, log.read_text()[-4000:]
    assert ids == {"v=2", "plain", "a=b", "x"}
    assert served.status_code == 200, served.text
