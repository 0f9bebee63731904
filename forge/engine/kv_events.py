"""KV-cache events in the wire format of vLLM's KV-event publisher, which LLM routers (vllm-router's
kv_aware policy) subscribe to: which full blocks of the prefix cache a replica holds. Pure data and the
encoder; the ZMQ socket that sends them is the shell's (actors/runtime/kv_publisher.py).

    batch  [ts, [event, ...], data_parallel_rank]           a positional array (array_like)
    event  {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": p | nil,
            "token_ids": [...], "block_size": n, "lora_id": nil, "medium": "GPU", "lora_name": nil}
           {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}
           {"type": "AllBlocksCleared"}

A block's hash is forge's prefix-cache chain key (forge.engine.block_table.block_hash) as an unsigned 64-bit
integer: opaque to the router, which matches prompts by the events' token ids and chains blocks by the
parent hash. The medium is vLLM's name for the device tier ("GPU"), which routers score as local.
"""

from __future__ import annotations

import msgspec

MEDIUM = "GPU"          # vLLM's MEDIUM_GPU: the tier a router credits in full
_U64 = (1 << 64) - 1


def wire_hash(chain_hash: int) -> int:
    """A chain key as the unsigned integer the wire carries (routers refuse negative hashes)."""
    return chain_hash & _U64


class KVCacheEvent(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Tagged by class name under "type", as vLLM's events are."""


class BlockStored(KVCacheEvent, frozen=True):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent, frozen=True):
    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM


class AllBlocksCleared(KVCacheEvent, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True):
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)
