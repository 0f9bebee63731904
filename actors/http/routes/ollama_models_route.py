"""Ollama's model routes: what forge serves, in Ollama's shapes, and a clear refusal of what it does not do.

    GET  /api/tags       every model served: name ("<id>:latest"), size, digest, details, modified_at
    GET  /api/ps         the loaded ones, with their memory, context and when keep_alive unloads them
    POST /api/show       one model: details, model_info (the GGUF metadata), its chat template, capabilities
    GET  /api/version    the Ollama API version forge follows, and forge's own
    /api/pull, /api/push, /api/create, /api/delete, /api/copy, /api/blobs/...: 501, forge serves the models
                         it was started with (`forge pull` and --model choose them)

The facts come from each model's file (forge.models.model_facts), read off the event loop once per file
version and kept. Every route asks for the API key like the others; errors are Ollama's `{"error": ...}`.
"""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actors.http.edge import json_response
from actors.http.model_resolver import ModelResolver, known_name
from actors.runtime.model_set import ModelEntry
from forge.api.ollama import ollama_output as wire
from forge.api.ollama.ollama_schema import decode_show
from forge.errors import ModelLoadError, RequestError
from forge.models.model_facts import ModelFacts, local_path, read_facts

NEVER_S = 10 * 365 * 86400.0        # a model with no keep_alive: ps says it expires in ten years
_REFUSED = ("pull", "push", "create", "delete", "copy")


class OllamaModelRoutes:
    def __init__(self, resolver: ModelResolver) -> None:
        """`resolver`: the gateway's edge checks, body reader and model set."""
        self._resolver = resolver
        self._facts: dict[tuple[str, float, int], ModelFacts] = {}   # by (path, mtime, size)

    def routes(self) -> list[Route]:
        return [Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/version", self.version, methods=["GET"]),
                *(Route(f"/api/{name}", self.refuse, methods=["POST", "DELETE"]) for name in _REFUSED),
                Route("/api/blobs/{digest}", self.refuse, methods=["HEAD", "POST"])]

    async def tags(self, request: Request) -> Response:
        entries = list(self._resolver.check_open(request).entries.values())
        return json_response({"models": [_listed(e, await self._read(e)) for e in entries]})

    async def ps(self, request: Request) -> Response:
        entries = self._resolver.check_open(request).loaded()
        out = []
        for entry in entries:
            row = _listed(entry, await self._read(entry))
            keep = entry.keep_alive if entry.keep_alive is not None else NEVER_S
            idle_for = 0.0 if entry.num_active else time.monotonic() - entry.last_used
            row.update(size=entry.memory_bytes or row["size"], size_vram=0,
                       expires_at=wire.created_at(time.time() + max(keep - idle_for, 0.0)),
                       context_length=entry.actors.served.max_model_len if entry.actors is not None else 0)
            out.append(row)
        return json_response({"models": out})

    async def show(self, request: Request) -> Response:
        models = self._resolver.check_open(request)
        req = decode_show(await self._resolver.body(request))
        entry = models.entry(known_name(models, req.model_name))      # 404 naming the ids served
        facts = await self._read(entry)
        return json_response(_shown(entry, facts))

    async def version(self, request: Request) -> Response:
        self._resolver.check_key(request)
        try:
            forge_version = importlib.metadata.version("forge")
        except importlib.metadata.PackageNotFoundError:     # run from a checkout that is not installed
            forge_version = "dev"
        return json_response({"version": wire.OLLAMA_API_VERSION, "forge_version": forge_version})

    async def refuse(self, request: Request) -> Response:
        self._resolver.check_key(request)
        raise RequestError(f"{request.url.path} is not supported: forge serves the models it was started with "
                           "(choose them with `forge serve --model`, fetch them with `forge pull`)",
                           status=501, type="not_implemented", code="not_supported")

    async def _read(self, entry: ModelEntry) -> ModelFacts | None:
        """The model's facts (None when its file is not on disk yet: a catalogue model not fetched)."""
        path = local_path(entry.source)
        if path is None:
            return None
        stat = path.stat()
        key = (str(path), stat.st_mtime, stat.st_size)
        if key not in self._facts:
            try:
                self._facts[key] = await anyio.to_thread.run_sync(read_facts, entry.source)
            except (ModelLoadError, OSError, ValueError):
                return None
        return self._facts[key]


def ollama_name(model_id: str) -> str:
    """The name Ollama's apps show and send back: the id with Ollama's default tag unless it has a tag."""
    return model_id if ":" in model_id else f"{model_id}:latest"


def _details(facts: ModelFacts | None) -> dict[str, Any]:
    if facts is None:
        return {"parent_model": "", "format": "", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": facts.format, "family": facts.family, "families": [facts.family],
            "parameter_size": facts.parameter_size, "quantization_level": facts.quantization}


def _listed(entry: ModelEntry, facts: ModelFacts | None) -> dict[str, Any]:
    """An /api/tags entry: the digest is the catalogue's sha256 of the file, or of its first MiB and size."""
    name = ollama_name(entry.model_id)
    return {"name": name, "model": name,
            "modified_at": wire.created_at(facts.modified_s if facts is not None else 0.0),
            "size": facts.size_bytes if facts is not None else entry.size_bytes,
            "digest": facts.digest.removeprefix("sha256:") if facts is not None else "",
            "details": _details(facts)}


def _shown(entry: ModelEntry, facts: ModelFacts | None) -> dict[str, Any]:
    """/api/show's body. Capabilities: an encoder embeds; a generation model completes, calls tools (forge's
    tool format where its template has none) and thinks where its template writes a section (/api/embed
    serves it too, as Ollama's does, but only an encoder is listed as an embedding model)."""
    handle = entry.actors.handle if entry.actors is not None else None
    if handle is not None and handle.embeds_only or facts is not None and facts.format == "safetensors":
        capabilities = ["embedding"]
    else:
        thinks = handle.reasoning_parser != "none" if handle is not None else facts is not None and facts.thinks
        capabilities = ["completion", "tools", *(["thinking"] if thinks else [])]
    template = facts.template if facts is not None else ""
    return {"license": "", "modelfile": f"# served by forge from {facts.path if facts else entry.source}\n",
            "parameters": "", "template": template, "details": _details(facts),
            "model_info": facts.info if facts is not None else {}, "capabilities": capabilities,
            "modified_at": wire.created_at(facts.modified_s if facts is not None else 0.0)}
