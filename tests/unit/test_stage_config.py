"""actors.ops.stage_config: what `forge stage-config` writes in the runtime directory, and what it refuses."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from actors.ops.stage_config import StageError, stage


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    etc, run = tmp_path / "etc", tmp_path / "run"
    etc.mkdir()
    run.mkdir()
    return etc, run


def test_a_missing_env_file_stages_an_empty_one_and_drops_a_tenant_file_no_longer_named(tmp_path: Path) -> None:
    etc, run = dirs(tmp_path)
    (etc / "keys.toml").write_text('[[tenant]]\nname = "a"\nkey = "k"\n')
    (etc / "forge.env").write_text(f"FORGE_API_KEYS_FILE='{etc}/keys.toml'\n# FORGE_API_KEYS_FILE=/elsewhere\n")
    stage(etc / "forge.env", run)
    assert (run / "forge.env").read_text() == f"FORGE_API_KEYS_FILE={run}/keys.toml\n# FORGE_API_KEYS_FILE=/elsewhere\n"
    (etc / "forge.env").unlink()
    assert stage(etc / "forge.env", run) == [run / "forge.env"]
    assert (run / "forge.env").read_text() == "" and not (run / "keys.toml").exists()
    assert stat.S_IMODE((run / "forge.env").stat().st_mode) == 0o400


def test_a_link_planted_in_the_runtime_directory_is_replaced_not_followed(tmp_path: Path) -> None:
    etc, run = dirs(tmp_path)
    target = tmp_path / "precious"
    target.write_text("unchanged")
    (run / "forge.env").symlink_to(target)
    (etc / "forge.env").write_text("FORGE_LOG=debug\n")
    stage(etc / "forge.env", run)
    assert target.read_text() == "unchanged" and not (run / "forge.env").is_symlink()
    assert (run / "forge.env").read_text() == "FORGE_LOG=debug\n"


@pytest.mark.parametrize(("text", "error"), [
    ("FORGE_LOG debug\n", "line 1 is not KEY=VALUE"),
    ("FORGE_API_KEYS_FILE=/nonexistent/keys.toml\n", "FORGE_API_KEYS_FILE /nonexistent/keys.toml: No such file"),
])
def test_a_bad_env_file_or_a_missing_tenant_file_is_one_line_and_writes_nothing(
        tmp_path: Path, text: str, error: str) -> None:
    etc, run = dirs(tmp_path)
    (etc / "forge.env").write_text(text)
    with pytest.raises(StageError, match=error):
        stage(etc / "forge.env", run)
    assert list(run.iterdir()) == []


def test_a_runtime_directory_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="No such file"):
        stage(tmp_path / "forge.env", tmp_path / "absent")
