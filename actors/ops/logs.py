"""structlog set-up: JSON lines for machines, readable lines on a terminal; request ids bound
through contextvars so every line of a request carries its id."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", fmt: str | None = None) -> None:
    """fmt: "json", "console", or None to pick console on a terminal and JSON otherwise."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    if fmt is None:
        fmt = "console" if sys.stderr.isatty() else "json"
    if fmt not in ("json", "console"):
        raise ValueError(f"unknown log format {fmt!r} (json or console)")
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, format="%(message)s")


def set_log_level(level: str) -> None:
    """A new level for every logger from now on (a reload); the format stays."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(numeric))
    logging.getLogger().setLevel(max(numeric, logging.WARNING))
