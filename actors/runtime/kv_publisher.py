"""Publishes the prefix cache's KV events (forge.engine.kv_events) on a ZMQ PUB socket, as vLLM's publisher does:
each batch is one message of three frames, (topic, sequence number as 8 bytes big-endian, msgpack batch).

The engine never waits on a subscriber: publish_nowait puts the batch on a bounded queue that one thread
sends from, and a batch that finds the queue full is dropped and counted. A dropped batch still takes its
sequence number, so a router sees the gap and forgets what it knew of this replica: that costs hits, never
correctness.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from forge.engine.kv_events import KVEvent, KVEventBatch, encode_batch

MAX_QUEUED_BATCHES = 10_000


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    endpoint: str = "tcp://*:5557"      # where the PUB socket binds
    topic: str = ""
    advertised: str | None = None       # what /kv_event_sources tells routers to connect to; None: derived


class KvEventPublisherStats(msgspec.Struct, frozen=True):
    num_published: int      # batches sent
    num_dropped: int        # batches dropped because the queue was full


class KvEventPublisher:
    """Binds at construction, so a bad endpoint (a port in use) fails the daemon's start, not later."""

    def __init__(self, config: KvEventsConfig, *, max_queued: int = MAX_QUEUED_BATCHES) -> None:
        self.config = config
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.set_hwm(100_000)
        try:
            self._sock.bind(config.endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise OSError(f"cannot bind the KV-event socket to {config.endpoint}: {exc}") from exc
        self.bound_endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(max_queued)
        self._seq = 0                   # the next batch's number; only publish_nowait's caller counts it
        self._num_published = 0
        self._num_dropped = 0
        self._thread = threading.Thread(target=self._send_loop, name="kv-events", daemon=True)
        self._thread.start()

    def source_endpoint(self, host: str) -> str:
        """The endpoint a subscriber connects to: the advertised one, or the bound one with a wildcard
        host replaced by `host` (the address the router reached this replica's HTTP port on)."""
        if self.config.advertised is not None:
            return self.config.advertised
        scheme, _, rest = self.bound_endpoint.partition("://")
        bind_host, _, port = rest.rpartition(":")
        if bind_host in ("*", "0.0.0.0", "[::]", "[::0]", ""):
            bind_host = host
        return f"{scheme}://{bind_host}:{port}"

    def publish_nowait(self, events: list[KVEvent]) -> None:
        """Queue `events` as one batch. Call it from one thread only (the allocator actor's)."""
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        try:
            self._queue.put_nowait((seq, KVEventBatch(ts=time.time(), events=tuple(events))))
        except queue.Full:
            self._num_dropped += 1

    def statistics(self) -> KvEventPublisherStats:
        return KvEventPublisherStats(num_published=self._num_published, num_dropped=self._num_dropped)

    def close(self) -> None:
        """Stop the thread (what is queued is sent first) and close the socket."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._sock.close()

    def _send_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            seq, batch = item
            try:
                self._sock.send_multipart((self._topic, seq.to_bytes(8, "big"), encode_batch(batch)))
            except zmq.ZMQError:
                self._num_dropped += 1
                continue
            self._num_published += 1
