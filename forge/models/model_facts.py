"""What a model's file says about it without loading it: format, family, parameter count, quantization, its
metadata and chat template, a digest and when it changed (Ollama's /api/tags and /api/show read these).

A GGUF file's header is read once (forge.models.gguf_file) and its large arrays (the vocabulary, merges) left
out; an encoder's directory (forge.models.bert) gives its config.json. The digest is the catalogue's sha256 of
the whole file for a model forge fetched by name, else the sha256 of the file's first MiB and its size (of
each file's name and size for a directory): stable across restarts and paths, and cheap to compute.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import LlamaFileType

from forge.errors import ModelLoadError
from forge.models import hub
from forge.models.bert.encoder import is_encoder_dir
from forge.models.gguf_file import read_gguf
from forge.sampling.reasoning import OPEN

_HEAD_BYTES = 1 << 20
MAX_LISTED_ITEMS = 64           # a metadata array longer than this (a vocabulary) is left out of model_info
TEMPLATE_KEY = "tokenizer.chat_template"


@dataclass(frozen=True, slots=True)
class ModelFacts:
    path: str
    format: str                                          # "gguf" or "safetensors"
    family: str                                          # the architecture ("llama", "gemma3", "bert")
    num_parameters: int
    quantization: str                                    # "Q4_1", "F32", ...
    size_bytes: int
    modified_s: float                                    # the file's mtime (Unix seconds)
    digest: str                                          # "sha256:<hex>"
    info: dict[str, Any] = field(default_factory=dict)   # the metadata, large arrays left out
    template: str = ""                                   # the chat template's source ("" when none)

    @property
    def parameter_size(self) -> str:
        """Ollama's way: "134.52M", "1.71B"."""
        n = self.num_parameters
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if n >= scale:
                return f"{n / scale:.2f}{unit}"
        return str(n)

    @property
    def thinks(self) -> bool:
        """Whether its template writes a thinking section (forge.sampling.reasoning's format "auto" finds one)."""
        return OPEN in self.template or "<|channel|>" in self.template


def local_path(source: str | None) -> Path | None:
    """Where a model entry's source is on disk, without fetching anything: a catalogue name's place (its
    unpacked directory for a zipped one), or the path itself; None when it is not there."""
    name = hub.DEFAULT_MODEL if source is None else source
    if name in hub.CATALOG and not Path(name).exists():
        model = hub.CATALOG[name]
        path = hub.model_path(name)
        if model.unpack_to is not None:
            path = path.parent / model.unpack_to
    else:
        path = Path(name).expanduser()
    return path if path.exists() else None


def read_facts(source: str | None) -> ModelFacts:
    """The facts of the model a `--model` source names (ModelLoadError when it is not on disk)."""
    path = local_path(source)
    if path is None:
        raise ModelLoadError(f"the model {source or hub.DEFAULT_MODEL!r} is not on disk")
    catalogued = hub.CATALOG.get(source or hub.DEFAULT_MODEL)
    if is_encoder_dir(path):
        return _encoder_facts(path)
    return _gguf_facts(path, catalogued.sha256 if catalogued is not None else None)


def _gguf_facts(path: Path, sha256: str | None) -> ModelFacts:
    gguf = read_gguf(path)
    meta = gguf.metadata
    family = str(meta.get("general.architecture", "unknown"))
    num_parameters = sum(math.prod(t.shape) for t in gguf.tensors.values())    # shapes are in values
    info = {k: _listed(v) for k, v in meta.items() if k != TEMPLATE_KEY and not k.startswith("tokenizer.ggml.")}
    info["general.parameter_count"] = num_parameters
    template = meta.get(TEMPLATE_KEY)
    stat = path.stat()
    return ModelFacts(path=str(path), format="gguf", family=family, num_parameters=num_parameters,
                      quantization=_file_type(meta.get("general.file_type")), size_bytes=stat.st_size,
                      modified_s=stat.st_mtime, digest=f"sha256:{sha256 or _head_digest(path, stat.st_size)}",
                      info={k: v for k, v in info.items() if v is not None},
                      template=template if isinstance(template, str) else "")


def _listed(value: Any) -> Any:
    """A metadata value as JSON: numbers, strings, short arrays; bytes and long arrays as None."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.size <= MAX_LISTED_ITEMS else None
    if isinstance(value, list):
        return value if len(value) <= MAX_LISTED_ITEMS and all(isinstance(v, str) for v in value) else None
    if isinstance(value, bytes):
        return None
    return value.item() if isinstance(value, np.generic) else value


def _file_type(value: Any) -> str:
    """general.file_type as Ollama names it: MOSTLY_Q4_1 -> "Q4_1"."""
    try:
        name = LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _head_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(_HEAD_BYTES))
    digest.update(str(size).encode())
    return digest.hexdigest()


def _encoder_facts(path: Path) -> ModelFacts:
    config = json.loads((path / "config.json").read_text())
    weights = path / "model.safetensors"
    files = sorted(p for p in path.iterdir() if p.is_file())
    digest = hashlib.sha256("".join(f"{p.name}:{p.stat().st_size};" for p in files).encode()).hexdigest()
    num_parameters = _safetensors_parameters(weights)
    return ModelFacts(path=str(path), format="safetensors", family=str(config.get("model_type", "bert")),
                      num_parameters=num_parameters, quantization="F32",
                      size_bytes=sum(p.stat().st_size for p in files), modified_s=os.path.getmtime(weights),
                      digest=f"sha256:{digest}",
                      info={f"bert.{k}": v for k, v in config.items() if isinstance(v, int | float | str)})


def _safetensors_parameters(path: Path) -> int:
    """The values a safetensors file holds, from its JSON header (8 bytes of length, then the header)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
