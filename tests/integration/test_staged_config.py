"""deploy/forge.service's ExecStartPre= and ExecReload= command lines, run as systemd would run them (the `+`
ones as root), with the unit's paths moved into a temporary directory: /etc/forge holds the operator's
root-only files, /run/forge (the RuntimeDirectory=) belongs to the service's user. The copies forge reads are
that user's alone, 0400; the originals stay unreadable to it; and a real `forge serve` reading only the copies
takes a changed tenant file on the unit's reload. As root, the service's user is `nobody`, as systemd's
transient user would be; otherwise it is this user (the ownership hand-over itself is not checked then).
"""

from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.integration.harness import HANG_GUARD_S, PROMPT, NotifySocket, free_port, wait_healthy, wait_until
from tests.integration.test_systemd import INSTALLED_VENV, env_file, unit_settings

REPO = Path(__file__).resolve().parents[2]
AS_ROOT = os.geteuid() == 0
SERVICE_UID = 65534 if AS_ROOT else os.getuid()          # nobody: a user that is not root
OLD, NEW = "staged-old-key-1", "staged-new-key-2"


def tenant_file(path: Path, **keys: str) -> None:
    path.write_text("".join(f'[[tenant]]\nname = "{name}"\nkey = "{key}"\n' for name, key in keys.items()))
    path.chmod(0o600)


class Layout:
    """The unit's paths under `root`: etc (/etc/forge, root's) and run (/run/forge, the service user's)."""

    def __init__(self, root: Path) -> None:
        self.etc, self.run = root / "etc", root / "run"
        self.etc.mkdir(mode=0o755)
        self.run.mkdir(mode=0o700)
        os.chown(self.run, SERVICE_UID, SERVICE_UID)
        self.venv = str(Path(sys.executable).parent.parent)

    def command(self, line: str, mainpid: int = 0) -> list[str]:
        """A unit's command line as this machine runs it; the `+` prefix (full privileges) is this process's."""
        assert line.startswith(("+", "/")), line
        line = (line.removeprefix("+").replace(INSTALLED_VENV, self.venv).replace("/etc/forge", str(self.etc))
                .replace("/run/forge", str(self.run)).replace("$MAINPID", str(mainpid)))
        return shlex.split(line)


@pytest.fixture
def paths() -> Iterator[Layout]:
    """The layout in a directory of its own under /tmp, which the service's user may enter (not pytest's
    tmp_path, whose parent only its owner may)."""
    with tempfile.TemporaryDirectory(prefix="forge-unit-") as root:
        os.chmod(root, 0o755)
        yield Layout(Path(root))


def run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})      # this checkout's forge


def readable_by_service(path: Path) -> bool:
    done = subprocess.run(["cat", str(path)], capture_output=True, check=False, user=SERVICE_UID, group=SERVICE_UID)
    return done.returncode == 0


def test_the_start_command_stages_the_root_only_files_for_the_services_user(paths: Layout) -> None:
    settings = unit_settings()
    [pre] = settings["ExecStartPre"]
    assert pre.startswith("+") and settings["RuntimeDirectory"] == ["forge"]
    assert settings["EnvironmentFile"] == ["-/run/forge/forge.env"]
    assert "FORGE_ENV_FILE=/run/forge/forge.env" in settings["Environment"]
    keys, env = paths.etc / "keys.toml", paths.etc / "forge.env"
    tenant_file(keys, old=OLD)
    env.write_text(f'FORGE_LOG=debug\nexport FORGE_API_KEYS_FILE="{paths.etc}/keys.toml"\n')
    env.chmod(0o600)
    done = run(paths.command(pre))
    assert done.returncode == 0, done.stderr
    staged = sorted(p.name for p in paths.run.iterdir())
    assert staged == ["forge.env", "keys.toml"], staged                 # and no temporary file left
    for name in staged:
        st = (paths.run / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o400 and (st.st_uid, st.st_gid) == (SERVICE_UID, SERVICE_UID), name
    assert (paths.run / "keys.toml").read_text() == keys.read_text()
    assert env_file(paths.run / "forge.env") == {"FORGE_LOG": "debug",
                                                 "FORGE_API_KEYS_FILE": f"{paths.run}/keys.toml"}
    if AS_ROOT:
        assert readable_by_service(paths.run / "keys.toml") and readable_by_service(paths.run / "forge.env")
        assert not readable_by_service(keys) and not readable_by_service(env)


def test_a_tenant_file_that_cannot_be_read_fails_the_command_and_keeps_the_copies(paths: Layout) -> None:
    [stage, _] = unit_settings()["ExecReload"]
    tenant_file(paths.etc / "keys.toml", old=OLD)
    (paths.etc / "forge.env").write_text(f"FORGE_API_KEYS_FILE={paths.etc}/keys.toml\n")
    assert run(paths.command(stage)).returncode == 0
    before = (paths.run / "forge.env").read_text()
    (paths.etc / "forge.env").write_text(f"FORGE_API_KEYS_FILE={paths.etc}/missing.toml\nFORGE_LOG=debug\n")
    done = run(paths.command(stage))
    assert done.returncode == 1 and done.stderr.splitlines() == [
        f"forge stage-config: FORGE_API_KEYS_FILE {paths.etc}/missing.toml: No such file or directory"], done.stderr
    assert (paths.run / "forge.env").read_text() == before             # systemd sends no SIGHUP after a failure


async def test_the_units_reload_commands_give_a_real_daemon_the_changed_tenant_file(
        paths: Layout, tmp_path: Path, default_model_path: Path) -> None:
    settings = unit_settings()
    [pre], reload_lines = settings["ExecStartPre"], settings["ExecReload"]
    assert reload_lines[0] == pre and reload_lines[1] == "/bin/kill -HUP $MAINPID"
    keys = paths.etc / "keys.toml"
    tenant_file(keys, old=OLD)
    (paths.etc / "forge.env").write_text(f"FORGE_API_KEYS_FILE={keys}\n")
    (paths.etc / "forge.env").chmod(0o600)
    assert run(paths.command(pre)).returncode == 0
    port, notify, log = free_port(), NotifySocket(), tmp_path / "forge.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "NOTIFY_", "WATCHDOG_", "LISTEN_"))}
    for assignment in settings["Environment"]:                           # the unit's, then its EnvironmentFile=
        key, value = assignment.split("=", 1)
        env[key] = value.replace("/run/forge", str(paths.run))
    env.update(env_file(paths.run / "forge.env"))
    env.update(FORGE_HOME=str(default_model_path.parent.parent), FORGE_ADDR=f"127.0.0.1:{port}",
               NOTIFY_SOCKET=notify.address, PYTHONPATH=str(REPO))
    assert env["FORGE_API_KEYS_FILE"] == str(paths.run / "keys.toml")
    with open(log, "wb") as out:
        proc = await anyio.open_process([sys.executable, "-m", "actors", "serve"], stdout=out,
                                        stderr=subprocess.STDOUT, env=env, cwd=tmp_path)

    def completion(key: str) -> Any:
        return http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                         headers={"Authorization": f"Bearer {key}"})

    try:
        with anyio.fail_after(HANG_GUARD_S):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HANG_GUARD_S) as http:
                await wait_healthy(http, proc, log.read_text)
                assert (await completion(OLD)).status_code == 200
                assert (await completion(NEW)).status_code == 401
                tenant_file(keys, new=NEW)
                num_ready = notify.lines().count("READY=1")
                for line in reload_lines:                                   # in order, as systemctl reload
                    done = run(paths.command(line, mainpid=proc.pid))
                    assert done.returncode == 0, done.stderr
                await wait_until(lambda: notify.lines().count("READY=1") > num_ready, interval=0.05)
                assert (await completion(NEW)).status_code == 200
                assert (await completion(OLD)).status_code == 401
                proc.send_signal(signal.SIGTERM)
                assert await proc.wait() == 0, log.read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        notify.close()
    assert '"reload_failed"' not in log.read_text()
