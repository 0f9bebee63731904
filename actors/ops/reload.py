"""`systemctl reload` (SIGHUP): the settings a running daemon reads again, each checked before any applies.

Re-read: the tenant file (--api-keys-file), and from the environment file systemd read at start
(FORGE_ENV_FILE; deploy/forge.service sets it to /etc/forge/forge.env) FORGE_API_KEY, FORGE_API_KEYS_FILE,
FORGE_LOG, FORGE_KEEP_ALIVE, FORGE_MAX_LOADED_MODELS and FORGE_MODELS_MEMORY. A setting given as a flag
on the command line keeps the flag's value (the flag wins, as at start). Anything wrong (an unreadable
file, a bad tenant, a bad value) fails the whole reload: the daemon keeps every setting it had. Another
FORGE_ variable whose value in the file differs from the one the daemon started with needs a restart:
one log line names it. `Reloader.reload` does it all, between RELOADING=1 and READY=1 to systemd's notify
socket; a request in flight keeps the settings it started with (its tenant, its model) to its end.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import structlog

from actors.http.tenant_limits import TenantGate
from actors.http.tenants import TenantFileError, TenantTable, load_tenants
from actors.ops.logs import set_log_level
from actors.ops.systemd_notify import Notifier
from actors.runtime.model_set import ModelSet, parse_keep_alive
from forge.config import parse_size
from forge.errors import RequestError

log = structlog.get_logger("forge.reload")

# The variables a reload reads, and the flag that pins each
LIVE = {"FORGE_API_KEY": "--api-key", "FORGE_API_KEYS_FILE": "--api-keys-file", "FORGE_LOG": "--log-level",
        "FORGE_KEEP_ALIVE": "--keep-alive", "FORGE_MAX_LOADED_MODELS": "--max-loaded-models",
        "FORGE_MODELS_MEMORY": "--models-memory"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class ReloadError(ValueError):
    """The reload cannot be applied; one line saying why."""


@dataclass(frozen=True, slots=True)
class LiveSettings:
    """What a reload can change, as the daemon runs with it."""
    api_key: str | None = None
    api_keys_file: str | None = None
    tenants: TenantTable | None = None
    log_level: str = "info"
    keep_alive: tuple[str, ...] = ()           # --keep-alive values: DURATION, or ID=DURATION
    max_loaded_models: int | None = None
    models_memory: int | None = None


@dataclass(slots=True)
class ReloadSource:
    """Where a reload reads from: `env_file` (None: the tenant file alone), the variables whose flags were
    given (`pinned`: not re-read), and the FORGE_ variables the daemon started with (`started_env`)."""
    env_file: str | None = None
    pinned: frozenset[str] = frozenset()
    started_env: dict[str, str] = field(default_factory=dict)


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them: blank lines and # or ; comments skipped, a
    value in quotes unquoted, `export ` before a key allowed. ReloadError if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ReloadError(f"FORGE_ENV_FILE {path}: {exc.strerror or exc}") from None
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip().isidentifier():
            raise ReloadError(f"FORGE_ENV_FILE {path}: line {number} is not KEY=VALUE")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            try:
                value = shlex.split(value)[0] if value[1:-1] else ""
            except ValueError:
                raise ReloadError(f"FORGE_ENV_FILE {path}: line {number} has an unclosed quote") from None
        out[key.strip()] = value
    return out


def next_settings(current: LiveSettings, source: ReloadSource) -> tuple[LiveSettings, list[str]]:
    """The settings after a reload, and the FORGE_ variables that changed but need a restart. ReloadError
    (one line) if any of it is wrong."""
    env = read_env_file(source.env_file) if source.env_file else None

    def value(name: str) -> str | None:
        if env is None or name in source.pinned:
            return None
        return env.get(name) or None

    def unset(name: str) -> bool:            # the file no longer sets a variable it may set
        return env is not None and name not in source.pinned and not env.get(name)

    keys_file = value("FORGE_API_KEYS_FILE") or (None if unset("FORGE_API_KEYS_FILE") else current.api_keys_file)
    try:
        tenants = load_tenants(keys_file) if keys_file else None
    except TenantFileError as exc:
        raise ReloadError(str(exc)) from None
    level = (value("FORGE_LOG") or ("info" if unset("FORGE_LOG") else current.log_level)).lower()
    if level not in LOG_LEVELS:
        raise ReloadError(f"FORGE_LOG: unknown log level {level!r} ({', '.join(LOG_LEVELS)})")
    keep_alive = value("FORGE_KEEP_ALIVE")
    max_loaded = value("FORGE_MAX_LOADED_MODELS")
    memory = value("FORGE_MODELS_MEMORY")
    try:
        max_loaded_models = (int(max_loaded) or None if max_loaded is not None
                             else None if unset("FORGE_MAX_LOADED_MODELS") else current.max_loaded_models)
        models_memory = (parse_size(memory) if memory is not None
                         else None if unset("FORGE_MODELS_MEMORY") else current.models_memory)
    except ValueError as exc:
        raise ReloadError(f"FORGE_MAX_LOADED_MODELS or FORGE_MODELS_MEMORY: {exc}") from None
    settings = LiveSettings(
        api_key=value("FORGE_API_KEY") or (None if unset("FORGE_API_KEY") else current.api_key),
        api_keys_file=keys_file, tenants=tenants, log_level=level,
        keep_alive=(tuple(v for v in keep_alive.split(",") if v) if keep_alive is not None
                    else () if unset("FORGE_KEEP_ALIVE") else current.keep_alive),
        max_loaded_models=max_loaded_models, models_memory=models_memory)
    restart = sorted(k for k, v in (env or {}).items() if k.startswith("FORGE_") and k not in LIVE
                     and k != "FORGE_ENV_FILE" and source.started_env.get(k, "") != v)
    return settings, restart


def pinned_variables(argv: list[str]) -> frozenset[str]:
    """The LIVE variables whose flag is on the command line `argv` (as --flag VALUE or --flag=VALUE)."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    return frozenset(name for name, flag in LIVE.items() if flag in given)


def started_env() -> dict[str, str]:
    """The FORGE_ variables of this process now (at start: what the daemon was started with)."""
    return {k: v for k, v in os.environ.items() if k.startswith("FORGE_")}


def keep_alive_by_model(values: tuple[str, ...], model_ids: list[str]) -> dict[str, float | None]:
    """Each model's keep_alive from --keep-alive values (DURATION for every model, ID=DURATION for one, later
    values winning); a model no value names is absent. ReloadError for an unknown id or a bad duration."""
    out: dict[str, float | None] = {}
    for value in values:
        target, _, duration = value.rpartition("=")
        if target and target not in model_ids:
            raise ReloadError(f"FORGE_KEEP_ALIVE names no served model: {target}")
        try:
            seconds = parse_keep_alive(_number_or_text(duration))
        except RequestError as exc:
            raise ReloadError(f"FORGE_KEEP_ALIVE: {exc.message}") from None
        out.update(dict.fromkeys([target] if target else model_ids, seconds))
    return out


def _number_or_text(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


class Reloader:
    """Applies a reload to the running daemon: its tenant gate, log level and models (see the module's docstring)."""

    def __init__(self, current: LiveSettings, source: ReloadSource, *, tenants: TenantGate, notifier: Notifier,
                 models: Callable[[], ModelSet | None], several: bool) -> None:
        """`models`: the model set once it exists; `several`: more than one model is served (keep_alive and
        the model limits apply only then, as at start)."""
        self.current = current
        self.source = source
        self._tenants, self._notifier, self._models, self._several = tenants, notifier, models, several
        self.num_reloads = 0

    def reload(self) -> bool:
        """Read everything again and apply it, or keep it all and log one error line; False if it failed."""
        self._notifier.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                            "STATUS=reloading")
        models = self._models()
        try:
            settings, restart = next_settings(self.current, self.source)
            keep = (keep_alive_by_model(settings.keep_alive, list(models.entries))
                    if models is not None and self._several else {})
        except ReloadError as exc:
            log.error("reload_failed", error=str(exc), kept="every setting as it was")
            self._notifier.send("READY=1", "STATUS=reload failed; serving with the settings it had")
            return False
        self._tenants.reload(settings.tenants, api_key=settings.api_key)
        set_log_level(settings.log_level)
        if models is not None and self._several:
            models.max_loaded, models.max_memory = settings.max_loaded_models, settings.models_memory
            for model_id, seconds in keep.items():
                models.entries[model_id].keep_alive = seconds
        self.current = replace(settings, tenants=None)      # the table lives in the gate
        self.num_reloads += 1
        log.info("reloaded", tenants=len(settings.tenants) if settings.tenants is not None else None,
                 api_key="set" if settings.api_key else "none", log_level=settings.log_level,
                 keep_alive=list(settings.keep_alive), max_loaded_models=settings.max_loaded_models,
                 models_memory=settings.models_memory)
        if restart:
            log.warning("reload_needs_restart", variables=restart)
        self._notifier.send("READY=1", "STATUS=reloaded")
        return True
