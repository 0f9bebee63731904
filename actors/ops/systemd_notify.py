"""systemd's notify and socket-activation protocols, for `forge serve` run as a Type=notify unit.

Notify (sd_notify(3)): one datagram of newline-separated KEY=VALUE lines to the unix socket that
$NOTIFY_SOCKET names (a path, or @name in the abstract namespace). Without NOTIFY_SOCKET nothing is sent
and nothing changes. The daemon sends READY=1 once its models can serve (the `ready` log line) and
STOPPING=1 when a drain starts; `run_reports` sends, every few seconds, STATUS= (what `systemctl status`
shows), EXTEND_TIMEOUT_USEC= while the models named at start load (TimeoutStartSec need not cover a big
model's load), and WATCHDOG=1 (every WATCHDOG_USEC/2 at least) while no engine step is stuck: a step
running past --watchdog stops the pings, and systemd restarts the service after WatchdogSec.

Socket activation (sd_listen_fds(3)): LISTEN_PID naming this process and LISTEN_FDS=N hand N listening
sockets as fds 3 to 3+N-1; forge serves on the first (`handed_listen_fd`). A dozen lines of `socket` and
`os.environ`: no library needed.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import anyio
import structlog

log = structlog.get_logger("forge.systemd")

STATUS_INTERVAL_S = 5.0        # how often STATUS= (and EXTEND_TIMEOUT_USEC= while loading) is sent
EXTEND_TIMEOUT_S = 30.0        # each EXTEND_TIMEOUT_USEC= gives the start this long from now
LISTEN_FDS_START = 3           # SD_LISTEN_FDS_START


class Notifier:
    """Sends sd_notify messages to the socket NOTIFY_SOCKET named; does nothing without one."""

    def __init__(self, address: str | None) -> None:
        self._address = ("\0" + address[1:]) if address and address.startswith("@") else address
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        return cls((os.environ if environ is None else environ).get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *lines: str) -> bool:
        """One datagram of the lines; False if none was sent (no socket, or it failed: logged once). Never
        blocks: a message systemd has no room for is dropped, the next one says the same."""
        if self._address is None or not lines:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("sd_notify_failed", error=str(exc))
                self._warned = True
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: MutableMapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of WATCHDOG_USEC, when systemd set it for this process."""
    environ = os.environ if environ is None else environ
    pid = environ.get("WATCHDOG_PID")
    try:
        usec = int(environ.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    if usec <= 0 or (pid is not None and pid != str(os.getpid())):
        return None
    return usec / 1e6 / 2


def handed_listen_fd(environ: MutableMapping[str, str] | None = None) -> int | None:
    """The listening socket systemd handed this process (fd 3), or None. The variables are removed, so
    that no child takes the socket for its own."""
    environ = os.environ if environ is None else environ
    pid, count = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(name, None)
    if pid != str(os.getpid()) or count is None or not count.isdigit() or int(count) < 1:
        return None
    if int(count) > 1:
        log.warning("listen_fds_ignored", handed=int(count), served=LISTEN_FDS_START)
    return LISTEN_FDS_START


def socket_address(fd: int) -> str:
    """HOST:PORT ([HOST]:PORT for IPv6, unix:PATH) of a listening socket, for the logs and the Host checks."""
    sock = socket.socket(fileno=fd)
    try:
        name = sock.getsockname()
        family = sock.family
    finally:
        sock.detach()                # the fd stays open, for hypercorn
    if family == socket.AF_INET6:
        return f"[{name[0]}]:{name[1]}"
    if family == socket.AF_INET:
        return f"{name[0]}:{name[1]}"
    return f"unix:{name}"


@dataclass(slots=True, frozen=True)
class Report:
    """The daemon now, as `run_reports` reads it."""
    status: str                    # the STATUS= text, without the tokens/s
    serving: bool                  # models loaded and serving (tokens/s is added)
    loading: bool                  # the models named at start are loading
    stuck: bool                    # an engine step runs past the watchdog: no WATCHDOG=1
    generation_tokens: float       # tokens generated so far, for tokens/s


async def run_reports(notifier: Notifier, read: Callable[[], Report], *, watchdog_s: float | None,
                      status_every: float = STATUS_INTERVAL_S) -> None:
    """Send STATUS=, WATCHDOG=1 and EXTEND_TIMEOUT_USEC= until cancelled (see the module's docstring)."""
    tick = min(status_every, watchdog_s) if watchdog_s is not None else status_every
    last_at, last_tokens = time.monotonic(), read().generation_tokens
    while True:
        report = read()
        now = time.monotonic()
        rate = (report.generation_tokens - last_tokens) / (now - last_at) if now > last_at else 0.0
        last_at, last_tokens = now, report.generation_tokens
        status = f"{report.status}, {rate:.1f} tokens/s" if report.serving else report.status
        lines = [f"STATUS={status}"]
        if watchdog_s is not None and not report.stuck:
            lines.append("WATCHDOG=1")
        if report.loading:
            lines.append(f"EXTEND_TIMEOUT_USEC={int(max(EXTEND_TIMEOUT_S, 3 * tick) * 1e6)}")
        notifier.send(*lines)
        await anyio.sleep(tick)
