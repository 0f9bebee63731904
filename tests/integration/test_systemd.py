"""The systemd unit in deploy/: `systemd-analyze verify` accepts it without a warning, and its exact
ExecStart command, with its Environment= lines and environment file, serves and drains.

Only the paths that differ on this machine change: the venv the unit expects at /opt/forge is this
checkout's, FORGE_HOME is the test cache (where `forge pull` put the model: the unit itself never
downloads at start-up, docs/operations.md), and the listen address is a free port.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import httpx

from tests.integration.harness import HANG_GUARD_S, free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "forge.service"
INSTALLED_VENV = "/opt/forge/.venv"


def unit_settings() -> dict[str, list[str]]:
    """The [Service] section's settings, in order, by key."""
    settings: dict[str, list[str]] = {}
    section = ""
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def local_unit(tmp_path: Path) -> Path:
    venv = Path(sys.executable).parent.parent
    path = tmp_path / "forge.service"
    path.write_text(UNIT.read_text().replace(INSTALLED_VENV, str(venv)))
    return path


def test_systemd_analyze_verifies_the_unit_without_a_warning(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "the test needs systemd-analyze: run scripts/install-test-deps"
    done = subprocess.run([analyze, "verify", "--man=no", str(local_unit(tmp_path))], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout == done.stderr == "", done.stdout + done.stderr


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            out[key] = value.strip('"')
    return out


async def test_the_units_exact_command_serves_and_drains(tmp_path: Path, default_model_path: Path) -> None:
    settings = unit_settings()
    [exec_start] = settings["ExecStart"]
    command = shlex.split(exec_start.replace(INSTALLED_VENV, str(Path(sys.executable).parent.parent)))
    assert command[1:] == ["serve"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(env_file(REPO / "deploy" / "forge.env.example"))     # the template /etc/forge/forge.env starts from
    for assignment in settings.get("Environment", []):
        key, value = assignment.split("=", 1)
        env[key] = value
    assert env["FORGE_HOME"] == "/var/cache/forge" and env["FORGE_DOWNLOAD"] == "0"
    port = free_port()
    env["FORGE_HOME"] = str(default_model_path.parent.parent)          # where `forge pull` put the model
    env["FORGE_ADDR"] = f"127.0.0.1:{port}"
    log = tmp_path / "forge.log"
    with open(log, "wb") as out:
        proc = await anyio.open_process(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, log.read_text)
                resp = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
                assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert b"downloading" not in log.read_bytes().lower()


async def test_under_the_unit_a_missing_model_is_a_one_line_error_not_a_download(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "empty"), FORGE_DOWNLOAD="0", FORGE_ADDR=f"127.0.0.1:{free_port()}")
    done = await anyio.run_process([sys.executable, "-m", "actors", "serve"], env=env, check=False)
    err = done.stderr.decode()
    assert done.returncode == 2 and "FORGE_DOWNLOAD=0" in err and "forge pull" in err, err
    assert not (tmp_path / "empty" / "models").exists()
