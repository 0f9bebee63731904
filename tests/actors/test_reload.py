"""What a reload reads: the environment file as systemd reads it, the settings that change live (a flag on
the command line pinning its own), the variables that need a restart, and a bad value failing it whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.ops.reload import (
    LiveSettings,
    ReloadError,
    ReloadSource,
    keep_alive_by_model,
    next_settings,
    pinned_variables,
    read_env_file,
)

TENANTS = '[[tenant]]\nname = "web"\nkey = "web-key-0001"\n'


def test_the_environment_file_is_read_as_systemd_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "forge.env"
    path.write_text('# a comment\n; another\n\nFORGE_LOG=debug\nexport FORGE_API_KEY="a b#c"\n'
                    "FORGE_MODELS_MEMORY='4GiB'\nFORGE_KEEP_ALIVE=\n  FORGE_MAX_WAITING = 9 \n")
    assert read_env_file(str(path)) == {"FORGE_LOG": "debug", "FORGE_API_KEY": "a b#c", "FORGE_MODELS_MEMORY": "4GiB",
                                        "FORGE_KEEP_ALIVE": "", "FORGE_MAX_WAITING": "9"}
    path.write_text("FORGE_LOG=debug\nnot a setting\n")
    with pytest.raises(ReloadError, match="line 2 is not KEY=VALUE"):
        read_env_file(str(path))
    with pytest.raises(ReloadError, match="missing.env"):
        read_env_file(str(tmp_path / "missing.env"))


def test_a_reload_takes_the_files_values_keeps_pinned_flags_and_names_what_needs_a_restart(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(TENANTS)
    env = tmp_path / "forge.env"
    env.write_text(f"FORGE_API_KEYS_FILE={keys}\nFORGE_LOG=WARNING\nFORGE_KEEP_ALIVE=5m,b=-1\n"
                   "FORGE_MAX_LOADED_MODELS=2\nFORGE_MODELS_MEMORY=1GiB\nFORGE_MAX_WAITING=9\nFORGE_ADDR=x:1\n")
    current = LiveSettings(api_key="old-key", log_level="info")
    source = ReloadSource(env_file=str(env), started_env={"FORGE_ADDR": "x:1", "FORGE_MAX_WAITING": "8"})
    settings, restart = next_settings(current, source)
    assert settings.tenants is not None and settings.tenants.find("web-key-0001") is not None
    assert settings.api_key is None                     # the file no longer sets it
    assert settings.log_level == "warning" and settings.keep_alive == ("5m", "b=-1")
    assert settings.max_loaded_models == 2 and settings.models_memory == 2**30
    assert restart == ["FORGE_MAX_WAITING"]             # FORGE_ADDR is as it started
    pinned = ReloadSource(env_file=str(env), pinned=pinned_variables(["serve", "--log-level=debug", "--api-key", "k"]))
    settings, _ = next_settings(LiveSettings(api_key="k", log_level="debug"), pinned)
    assert settings.log_level == "debug" and settings.api_key == "k"      # the flags win, as at start


def test_without_an_environment_file_only_the_tenant_file_is_read_again(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(TENANTS)
    current = LiveSettings(api_key="k", api_keys_file=str(keys), log_level="debug", max_loaded_models=3)
    settings, restart = next_settings(current, ReloadSource())
    assert settings.tenants is not None and len(settings.tenants) == 1 and restart == []
    assert (settings.api_key, settings.log_level, settings.max_loaded_models) == ("k", "debug", 3)
    keys.write_text(TENANTS.replace("web-key-0001", "short"))
    with pytest.raises(ReloadError, match="key must be"):
        next_settings(current, ReloadSource())


@pytest.mark.parametrize(("line", "names"), [
    ("FORGE_LOG=loud", "FORGE_LOG"), ("FORGE_MAX_LOADED_MODELS=two", "FORGE_MAX_LOADED_MODELS"),
    ("FORGE_MODELS_MEMORY=lots", "FORGE_MODELS_MEMORY"), ("FORGE_API_KEYS_FILE=/nonexistent.toml", "nonexistent"),
])
def test_a_bad_value_fails_the_whole_reload_naming_it(tmp_path: Path, line: str, names: str) -> None:
    env = tmp_path / "forge.env"
    env.write_text(line + "\n")
    with pytest.raises(ReloadError, match=names):
        next_settings(LiveSettings(), ReloadSource(env_file=str(env)))


def test_keep_alive_values_apply_to_every_model_or_the_one_named() -> None:
    assert keep_alive_by_model(("5m", "b=-1", "c=30s"), ["a", "b", "c"]) == {"a": 300.0, "b": None, "c": 30.0}
    with pytest.raises(ReloadError, match="names no served model: d"):
        keep_alive_by_model(("d=5m",), ["a"])
    with pytest.raises(ReloadError, match="FORGE_KEEP_ALIVE"):
        keep_alive_by_model(("soon",), ["a"])
