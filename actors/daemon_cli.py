"""The `forge` command as installed: the core's commands plus `serve` and the HTTP benchmarks.

`forge serve` runs the daemon; `forge bench serve|compare` drive servers over HTTP. Everything
else (pull, generate, the offline bench) is the core's own command line, forge.core_cli.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

import structlog

from forge import core_cli
from forge.core_cli import add_engine_flags, engine_config, env
from forge.errors import ForgeError, RequestError

if TYPE_CHECKING:
    from actors.runtime.kv_publisher import KvEventsConfig
    from actors.runtime.model_set import ModelEntry


def _cmd_serve(args: argparse.Namespace) -> int:
    import anyio

    from actors.http.browser_guard import policy_for
    from actors.http.gateway import GatewayConfig
    from actors.http.tenants import TenantFileError, load_tenants
    from actors.ops.logs import configure_logging
    from actors.ops.reload import ReloadSource, pinned_variables, started_env
    from actors.ops.systemd_notify import handed_listen_fd, socket_address
    from actors.supervisor import FINAL_WRITE_S, Daemon, DaemonConfig, hypercorn_config, serve_daemon
    from forge.api.responses.responses_store import ResponseStore
    from forge.config import parse_size

    handed = handed_listen_fd()          # systemd socket activation (forge.socket): serve on fd 3, not --addr
    addr = socket_address(handed) if handed is not None else args.addr
    try:
        configure_logging(args.log_level, args.log_format)
        browser = policy_for(addr, allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins)
        body = parse_size(args.max_body_size)
        ResponseStore(max_responses=args.responses_store_size, ttl_s=args.responses_ttl)   # checks both
        if args.max_unsent_tokens < 1:
            raise ValueError(f"--max-unsent-tokens must be at least 1, got {args.max_unsent_tokens}")
        if not args.model_turn_wait >= 0:
            raise ValueError(f"--model-turn-wait must be at least 0 seconds, got {args.model_turn_wait}")
    except ValueError as exc:
        raise SystemExit(f"forge: {exc}") from None
    from forge.models.hub import CATALOG

    sources = list(args.model or _listed("FORGE_MODEL"))
    if args.models_dir is not None:
        if not os.path.isdir(args.models_dir):
            raise SystemExit(f"forge: --models-dir is not a directory: {args.models_dir}")
        sources += sorted(os.path.join(args.models_dir, f) for f in os.listdir(args.models_dir) if f.endswith(".gguf"))
    for source in sources:
        path = model_source(source)[1] if len(sources) > 1 else source
        if not os.path.isfile(path) and path not in CATALOG:
            raise SystemExit(f"forge: model file not found: {path} "
                             f"(or name a model forge fetches: {', '.join(CATALOG)})")
    model = sources[0] if len(sources) == 1 else None
    name = args.served_model_name or (os.path.basename(model).removesuffix(".gguf") if model
                                      else "SmolLM2-135M-Instruct")
    try:
        keep_alive = args.keep_alive or _listed("FORGE_KEEP_ALIVE")
        many = model_entries(sources, keep_alive) if len(sources) > 1 else []
        models_memory = parse_size(args.models_memory) if args.models_memory else None
    except (ValueError, RequestError) as exc:
        raise SystemExit(f"forge: {exc}") from None
    preload = args.preload or _listed("FORGE_PRELOAD")
    unknown = [m for m in preload if m not in {e.model_id for e in many}]
    if unknown:
        raise SystemExit(f"forge: --preload names no served model: {', '.join(unknown)}")
    try:
        tenants = load_tenants(args.api_keys_file) if args.api_keys_file else None
    except TenantFileError as exc:
        print(f"forge: {exc}", file=sys.stderr)
        return 2
    try:
        kv_events = _kv_events(args)
    except OSError as exc:
        print(f"forge: {exc} (--kv-events-endpoint or FORGE_KV_EVENTS_ENDPOINT)", file=sys.stderr)
        return 2
    config = DaemonConfig(
        engine=engine_config(args),
        gateway=GatewayConfig(served_model_name=name, api_key=args.api_key, tenants=tenants, max_body_size=body,
                              max_waiting=args.max_waiting, max_queued_tokens=args.max_queued_tokens,
                              watchdog_s=args.watchdog, body_timeout=args.body_timeout,
                              responses_store_size=args.responses_store_size, responses_ttl_s=args.responses_ttl,
                              max_unsent_tokens=args.max_unsent_tokens,
                              browser=browser),
        model=model, drain_timeout=args.drain_timeout, models=many, max_loaded_models=args.max_loaded_models,
        models_memory=models_memory, model_turn_wait=args.model_turn_wait, preload=preload, kv_events=kv_events,
        handed_socket=handed is not None, api_keys_file=args.api_keys_file, log_level=args.log_level,
        keep_alive=keep_alive, reload_source=ReloadSource(env_file=env("FORGE_ENV_FILE", None),
                                                          pinned=pinned_variables(sys.argv), started_env=started_env()))
    listen = hypercorn_config(args.addr, fd=handed)
    if handed is not None:
        structlog.get_logger("forge").info("socket_activated", addr=addr)
        listen.backlog = HANDED_BACKLOG              # asyncio listens again: keep the socket unit's Backlog=
        listen.graceful_timeout = args.drain_timeout + FINAL_WRITE_S + 1   # hypercorn stops at the drain's start
    elif not args.addr.startswith(("fd://", "unix:")):  # an inherited fd or a socket file: not probed
        try:    # the address tried before anything starts: a port in use is one line, not a crash report
            probe = listen.create_sockets()
        except OSError as exc:
            print(f"forge: cannot listen on {args.addr}: {exc.strerror or exc} (--addr or FORGE_ADDR)",
                  file=sys.stderr)
            return 2
        for sock in (*probe.secure_sockets, *probe.insecure_sockets, *probe.quic_sockets):
            sock.close()
    try:
        anyio.run(serve_daemon, Daemon(config), listen)
    except Exception as exc:  # noqa: BLE001 - the daemon's last word: one clear line, then exit
        causes = _leaves(exc)
        user_errors = [e for e in causes if isinstance(e, ForgeError)]
        if user_errors and len(user_errors) == len(causes):
            print(f"forge: {user_errors[0]}", file=sys.stderr)
            return 2
        structlog.get_logger("forge").exception("daemon_crashed")
        return 1
    return 0


HANDED_BACKLOG = 4096       # deploy/forge.socket's Backlog= (the kernel caps it at net.core.somaxconn)


def model_entries(sources: list[str], keep_alive: list[str]) -> list[ModelEntry]:
    """Each model's id: ID=MODEL's ID, a catalog name, or the file's name without .gguf; and its
    keep_alive (--keep-alive DURATION for all, ID=DURATION for one)."""
    from actors.runtime.model_set import ModelEntry, parse_keep_alive

    entries: list[ModelEntry] = []
    for source in sources:
        model_id, path = model_source(source)
        model_id = model_id or os.path.basename(path).removesuffix(".gguf")
        if model_id in {e.model_id for e in entries}:
            raise ValueError(f"two models have the id '{model_id}' (name one with ID=MODEL)")
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        entries.append(ModelEntry(model_id=model_id, source=path, size_bytes=size))
    by_id = {e.model_id: e for e in entries}
    for value in keep_alive:
        target, _, duration = value.rpartition("=")
        if target and target not in by_id:
            raise ValueError(f"--keep-alive names no served model: {target}")
        for entry in [by_id[target]] if target else entries:
            entry.keep_alive = parse_keep_alive(_number_or_text(duration))
    return entries


def model_source(source: str) -> tuple[str, str]:
    """(id, model) of a --model value or a --models-dir file: ID=MODEL, or a model alone (id ""). A path
    that exists as a file is a path, "=" in its name or not; otherwise the first "=" ends the id."""
    from forge.models.hub import CATALOG

    if "=" not in source or os.path.isfile(source) or source in CATALOG:
        return "", source
    model_id, _, path = source.partition("=")
    return model_id, path


def _listed(variable: str) -> list[str]:
    return [v for v in (env(variable, "") or "").split(",") if v]


def _number_or_text(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or the exception itself."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("--addr", default=env("FORGE_ADDR", "127.0.0.1:8080"),
                       help="listen address HOST:PORT [FORGE_ADDR; 127.0.0.1:8080]")
    serve.add_argument("--api-key", default=env("FORGE_API_KEY", None),
                       help="require 'Authorization: Bearer KEY' on every route but /healthz, /health (the same, for "
                            "LLM routers) and /dashboard (a page that holds no data and asks for the key) "
                            "[FORGE_API_KEY; none]")
    serve.add_argument("--api-keys-file", default=env("FORGE_API_KEYS_FILE", None),
                       help="a TOML file of tenants, each a [[tenant]] table with name, key (or key_sha256), "
                            "priority, share, max_concurrent, tokens_per_minute (docs/operations.md); a "
                            "request's key names its tenant; re-read on SIGHUP [FORGE_API_KEYS_FILE; none]")
    serve.add_argument("--allowed-hosts", default=env("FORGE_ALLOWED_HOSTS", None),
                       help="comma-separated names the daemon answers to besides localhost and IP addresses "
                            "(a port is ignored; *.example.com: every name under it; *: any); other Host "
                            "headers get 421; listening on 0.0.0.0 or :: any Host is served unless this "
                            "is given [FORGE_ALLOWED_HOSTS; none]")
    serve.add_argument("--allowed-origins", default=env("FORGE_ALLOWED_ORIGINS", None),
                       help="comma-separated origins of web pages allowed to call the API, with CORS "
                            "(https://app.example.com; *: any); a request from any other page but the "
                            "daemon's own gets 403 [FORGE_ALLOWED_ORIGINS; none]")
    serve.add_argument("--served-model-name", default=env("FORGE_SERVED_MODEL_NAME", None),
                       help="the model id clients send and /v1/models lists "
                            "[FORGE_SERVED_MODEL_NAME; the model file's name without .gguf]")
    serve.add_argument("--log-level", default=env("FORGE_LOG", "info"),
                       help="debug, info, warning, error or critical [FORGE_LOG; info]")
    serve.add_argument("--log-format", choices=["json", "console"], default=env("FORGE_LOG_FORMAT", None),
                       help="[FORGE_LOG_FORMAT; console on a terminal, else json]")
    serve.add_argument("--max-waiting", type=int, default=int(env("FORGE_MAX_WAITING", "256") or 256),
                       help="queued requests beyond which new ones get 503 [FORGE_MAX_WAITING; 256]")
    serve.add_argument("--max-queued-tokens", type=int,
                       default=int(env("FORGE_MAX_QUEUED_TOKENS", "262144") or 262144),
                       help="queued prompt tokens beyond which new requests get 503 [FORGE_MAX_QUEUED_TOKENS; 262144]")
    serve.add_argument("--max-body-size", default=env("FORGE_MAX_BODY_SIZE", "1MiB"),
                       help="largest request body; beyond it 413 [FORGE_MAX_BODY_SIZE; 1MiB]")
    serve.add_argument("--body-timeout", type=float, default=float(env("FORGE_BODY_TIMEOUT", "30") or 30),
                       help="seconds a request body has to arrive whole; after it 408 and the connection "
                            "closes [FORGE_BODY_TIMEOUT; 30]")
    serve.add_argument("--max-unsent-tokens", type=int,
                       default=int(env("FORGE_MAX_UNSENT_TOKENS", "4096") or 4096),
                       help="tokens a response may have generated and not yet sent to a client that stopped "
                            "reading it; past them it is ended and its sequence freed "
                            "[FORGE_MAX_UNSENT_TOKENS; 4096]")
    serve.add_argument("--responses-store-size", type=int,
                       default=int(env("FORGE_RESPONSES_STORE_SIZE", "1024") or 1024),
                       help="responses kept in memory for GET /v1/responses/{id} and previous_response_id, "
                            "the oldest dropped first; 0 stores none [FORGE_RESPONSES_STORE_SIZE; 1024]")
    serve.add_argument("--responses-ttl", type=float, default=float(env("FORGE_RESPONSES_TTL", "3600") or 3600),
                       help="seconds a stored response is kept [FORGE_RESPONSES_TTL; 3600]")
    serve.add_argument("--watchdog", type=float, default=float(env("FORGE_WATCHDOG_S", "60") or 60),
                       help="seconds one engine step may run before /healthz answers 503 'stuck' (and it is "
                            "logged), for systemd's watchdog or a load balancer to act [FORGE_WATCHDOG_S; 60]")
    serve.add_argument("--drain-timeout", type=float, default=float(env("FORGE_DRAIN_TIMEOUT", "30") or 30),
                       help="seconds running requests get to finish on SIGTERM [FORGE_DRAIN_TIMEOUT; 30]")
    serve.add_argument("--kv-events", action="store_true", default=env("FORGE_KV_EVENTS", "0") == "1",
                       help="publish the prefix cache's KV events (blocks stored, removed, all cleared) in vLLM's "
                            "format on a ZMQ PUB socket, for vllm-router's kv_aware policy "
                            "[FORGE_KV_EVENTS=1; not published]")
    serve.add_argument("--kv-events-endpoint", default=env("FORGE_KV_EVENTS_ENDPOINT", "tcp://*:5557"),
                       help="where the KV-event socket binds [FORGE_KV_EVENTS_ENDPOINT; tcp://*:5557]")
    serve.add_argument("--kv-events-topic", default=env("FORGE_KV_EVENTS_TOPIC", ""),
                       help="the topic frame of each KV-event message (vllm-router's --kv-event-source "
                            "subscribes to the empty one) [FORGE_KV_EVENTS_TOPIC; no topic]")
    serve.add_argument("--models-dir", default=env("FORGE_MODELS_DIR", None),
                       help="serve every .gguf file in DIR too, each under its file's name "
                            "[FORGE_MODELS_DIR; none]")
    serve.add_argument("--max-loaded-models", type=int,
                       default=int(env("FORGE_MAX_LOADED_MODELS", "0") or 0) or None,
                       help="with several models: most loaded at once; loading another unloads the least "
                            "recently used idle one, or a busy one drains first when a request for another "
                            "has waited --model-turn-wait [FORGE_MAX_LOADED_MODELS; no limit]")
    serve.add_argument("--model-turn-wait", type=float,
                       default=float(env("FORGE_MODEL_TURN_WAIT", "3") or 3),
                       help="with several models and no room to load one: seconds its oldest request waits "
                            "before a busy loaded model stops admitting, drains and makes room "
                            "[FORGE_MODEL_TURN_WAIT; 3]")
    serve.add_argument("--models-memory", default=env("FORGE_MODELS_MEMORY", None),
                       help="with several models: weights + K/V the loaded ones may hold (e.g. 4GiB) "
                            "[FORGE_MODELS_MEMORY; no limit]")
    serve.add_argument("--keep-alive", action="append", default=None,
                       help="with several models: unload a model idle this long (30s, 5m; -1: never); "
                            "ID=DURATION for one model; the variable comma-separated [FORGE_KEEP_ALIVE; none]")
    serve.add_argument("--preload", action="append", default=None,
                       help="with several models: load this model id at start; the variable "
                            "comma-separated [FORGE_PRELOAD; none]")
    add_engine_flags(serve, many_models=True)
    serve.set_defaults(func=_cmd_serve)
    stage = sub.add_parser("stage-config", help="copy a root-only environment file and the tenant file it names "
                           "into DIR, readable by DIR's owner alone (deploy/forge.service runs it as root)")
    stage.add_argument("env_file", help="the operator's environment file (/etc/forge/forge.env)")
    stage.add_argument("dir", help="where the copies go, owned by the service's user (/run/forge)")
    stage.set_defaults(func=_cmd_stage_config)


def _cmd_stage_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from actors.ops.stage_config import StageError, stage

    try:
        stage(Path(args.env_file), Path(args.dir))
    except StageError as exc:
        print(f"forge stage-config: {exc}", file=sys.stderr)
        return 1
    return 0


def _kv_events(args: argparse.Namespace) -> KvEventsConfig | None:
    """The KV-event config of the flags; the endpoint is bound once here and closed, so that one in use
    (or malformed) is a one-line error before the model loads."""
    if not args.kv_events:
        return None
    from actors.runtime.kv_publisher import KvEventPublisher, KvEventsConfig

    config = KvEventsConfig(endpoint=args.kv_events_endpoint, topic=args.kv_events_topic)
    KvEventPublisher(config).close()
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] in (["bench", "serve"], ["bench", "compare"]):
        from forge_bench import bench_cli

        return bench_cli.main(argv[1:])
    return core_cli.main(argv, register)
