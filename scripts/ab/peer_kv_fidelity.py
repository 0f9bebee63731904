"""How much llama-server's 8-bit K/V cache changes its own greedy output: the yardstick for forge's int8.

Starts the natively built llama-server (scripts/peer/peer_llama.sh) on the default model once per cache
type (`-ctk T -ctv T`, --cache-types: f16 first, then q8_0 and the others), runs every greedy case of
the committed reference data (prompt token ids, greedy, the reference's number of tokens, eos
ignored) through each, and prints how many continuations of each type equal the first type's,
and how many equal transformers' reference, up to the reference's first near-tie
(tests/reference_cases.greedy_agrees). scripts/ab/kv_fidelity.py prints forge's figures the same two
ways. Figures only.

    .venv/bin/python scripts/ab/peer_kv_fidelity.py [--llama-server PATH] [--port 8093] [--cache-types f16,q8_0,bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from forge.models.hub import resolve_model  # noqa: E402
from tests.reference_cases import greedy_agrees  # noqa: E402


def post(port: int, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply: dict[str, Any] = json.loads(response.read())
    return reply


def wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit("llama-server did not become ready")


def continuations(binary: str, model: str, port: int, cache_type: str, data: dict[str, Any]) -> list[list[int]]:
    """Every greedy case's tokens from one llama-server with K and V cached as `cache_type`."""
    command = [binary, "-m", model, "--port", str(port), "--host", "127.0.0.1", "--threads", "2", "-np", "1",
               "-c", "4096", "--no-repack", "-ctk", cache_type, "-ctv", cache_type, "--no-warmup"]
    try:                                     # a server already there would answer for ours
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        raise SystemExit(f"port {port} is taken: stop what listens there, or pass --port")
    except (urllib.error.URLError, OSError):
        pass
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_ready(port, proc)
        out = []
        for case in data["greedy"]:
            reply = post(port, {"prompt": case["prompt_ids"], "n_predict": data["num_greedy_tokens"],
                                "temperature": 0.0, "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                                "return_tokens": True, "samplers": ["top_k"]})
            out.append([int(t) for t in reply["tokens"]])
        return out
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=None, help="its binary (default: scripts/peer/peer_llama.sh's)")
    parser.add_argument("--port", type=int, default=8093)
    parser.add_argument("--cache-types", default="f16,q8_0,bf16,q4_0")
    args = parser.parse_args()
    binary = args.llama_server or subprocess.run(["bash", str(ROOT / "scripts/peer/peer_llama.sh")], check=True,
                                                 capture_output=True, text=True).stdout.strip()
    data = json.loads((ROOT / "tests/data/smollm2_reference.json").read_text())
    model = str(resolve_model(None, lambda _m: None))
    types = args.cache_types.split(",")
    runs = {t: continuations(binary, model, args.port, t, data) for t in types}
    cases = data["greedy"]

    def kept(outputs: list[list[int]], against: list[list[int]]) -> int:
        return sum(greedy_agrees({**case, "output_ids": want}, got)
                   for case, got, want in zip(cases, outputs, against, strict=True))

    reference = [c["output_ids"] for c in cases]
    print(f"llama-server {binary}; {len(cases)} greedy cases of {data['num_greedy_tokens']} tokens")
    print(f"cache   keeps the {types[0]} cache's continuation   equals transformers' reference")
    for t in types:
        print(f"{t:7s} {kept(runs[t], runs[types[0]]):>3d} / {len(cases):<3d}                       "
              f"{kept(runs[t], reference):>3d} / {len(cases)}")


if __name__ == "__main__":
    main()
