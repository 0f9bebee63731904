"""The KV-event publisher: vLLM's frames (topic, 8-byte big-endian sequence number, msgpack batch) to a real
ZMQ subscriber; a full queue drops batches at once instead of waiting, counts them, and leaves the gap in
the sequence numbers a subscriber detects; an endpoint in use is refused at construction."""

from __future__ import annotations

import socket

import pytest
import zmq

from actors.runtime.kv_publisher import KvEventPublisher, KvEventsConfig
from forge.engine.kv_events import AllBlocksCleared, BlockStored, decode_batch

STORED = BlockStored(block_hashes=(5,), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=4)


def subscriber(endpoint: str) -> zmq.Socket[bytes]:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket[bytes]) -> tuple[bytes, int, object]:
    assert sub.poll(10_000), "no message (hang guard)"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)


def wait_subscribed(pub: KvEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish probes until one arrives (a PUB socket drops what it sends before the SUB has joined)."""
    while True:
        pub.publish_nowait([AllBlocksCleared()])
        if sub.poll(100):
            _, seq, _ = receive(sub)
            while sub.poll(100):
                _, seq, _ = receive(sub)
            return seq


def test_batches_arrive_in_vllms_frames_in_order() -> None:
    pub = KvEventPublisher(KvEventsConfig(endpoint="tcp://127.0.0.1:*", topic="kv"))
    sub = subscriber(pub.bound_endpoint)
    try:
        last = wait_subscribed(pub, sub)
        pub.publish_nowait([STORED])
        pub.publish_nowait([])                                  # nothing to say: no message
        pub.publish_nowait([AllBlocksCleared()])
        first, second = receive(sub), receive(sub)
    finally:
        sub.close(linger=0)
        pub.close()
    assert first[0] == b"kv" and first[1] == last + 1 and first[2].events == (STORED,)   # type: ignore[attr-defined]
    assert second[1] == last + 2 and second[2].events == (AllBlocksCleared(),)           # type: ignore[attr-defined]
    assert pub.statistics().num_dropped == 0


def test_a_full_queue_drops_and_counts_and_leaves_a_gap() -> None:
    pub = KvEventPublisher(KvEventsConfig(endpoint="tcp://127.0.0.1:*"), max_queued=1)
    sub = subscriber(pub.bound_endpoint)
    try:
        start = wait_subscribed(pub, sub)
        for _ in range(200):                                    # far faster than one thread sends
            pub.publish_nowait([STORED])
        seqs = []
        while sub.poll(500):                                    # the queue drained
            seqs.append(receive(sub)[1])
        pub.publish_nowait([AllBlocksCleared()])
        _, after, _ = receive(sub)
    finally:
        sub.close(linger=0)
        pub.close()
    assert pub.statistics().num_dropped == 200 - len(seqs) > 0
    assert after == start + 201                                 # dropped batches kept their numbers
    assert len(seqs) < after - start - 1                        # so the subscriber sees the gap


def test_an_endpoint_in_use_is_refused_at_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(OSError, match="cannot bind the KV-event socket"):
            KvEventPublisher(KvEventsConfig(endpoint=endpoint))


def test_a_wildcard_bind_is_advertised_at_the_host_the_router_reached() -> None:
    pub = KvEventPublisher(KvEventsConfig(endpoint="tcp://*:0"))
    try:
        port = pub.bound_endpoint.rsplit(":", 1)[1]
        assert pub.source_endpoint("10.0.0.7") == f"tcp://10.0.0.7:{port}"
    finally:
        pub.close()
