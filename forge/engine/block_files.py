"""The files of the K/V cache's disk tier (forge.engine.disk_tier): one full block per file, and the keys
that name them.

    header   magic "FKVB" | version u16 | 0 u16 | fingerprint 16B | key 16B | num_tokens u32 | payload_len u64
    tokens   num_tokens x int32 (the block's own token ids)
    payload  payload_len bytes (every layer's K, then every layer's V, as the cache stores them)
    trailer  crc32 u32 of everything before it

A block's key is a chain of BLAKE2b digests over its tokens and every token before it, from a root that
holds the cache salt: equal keys mean equal prefixes (the prefix cache's own chain hash, Python's `hash`,
is neither stable across processes nor collision-resistant). The fingerprint names what makes K/V differ
(model file, K/V dtype and layout, numerics, block size, FORMAT_VERSION): the tier keeps its files in a
directory named by it. A file is written whole to a temporary name and renamed over its own (atomic); a
reader checks the header, the tokens and the checksum, and any mismatch is a miss (read_block: None),
never K/V of another prefix. crc32 because it is fast (2.6 GB/s here, BLAKE2b 1.05): it guards against
torn and corrupt files, not against someone who can write the directory.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

MAGIC = b"FKVB"
FORMAT_VERSION = 1
KEY_BYTES = 16
_HEADER = struct.Struct("<4sHH16s16sIQ")
_TRAILER = struct.Struct("<I")
SUFFIX = ".kvb"


def root_key(cache_salt: str | None) -> bytes:
    """The parent key of a sequence's first block: one root unsalted, one per salt (tenant) otherwise."""
    seed = b"forge-kv-root" if cache_salt is None else b"forge-kv-salt\0" + cache_salt.encode()
    return hashlib.blake2b(seed, digest_size=KEY_BYTES).digest()


def chain_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: its tokens and the key of the block before it."""
    return hashlib.blake2b(parent + np.asarray(token_ids, dtype="<i4").tobytes(), digest_size=KEY_BYTES).digest()


def prefix_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None, num_blocks: int) -> list[bytes]:
    """The keys of the first `num_blocks` full blocks of `token_ids`."""
    keys, parent = [], root_key(cache_salt)
    for i in range(num_blocks):
        parent = chain_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def key_of(name: str) -> bytes | None:
    """The key a file's name holds; None for a name that is not a block file's."""
    if not name.endswith(SUFFIX) or len(name) != 2 * KEY_BYTES + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:-len(SUFFIX)])
    except ValueError:
        return None


def file_size(num_tokens: int, payload_len: int) -> int:
    return _HEADER.size + 4 * num_tokens + payload_len + _TRAILER.size


def write_block(directory: Path, fingerprint: bytes, key: bytes, token_ids: Sequence[int],
                payload: bytes | memoryview) -> int:
    """Write one block's file atomically (a temporary file renamed over the name); returns its size.
    Raises OSError (a full or read-only disk) with no file left behind."""
    tokens = np.asarray(token_ids, dtype="<i4").tobytes()
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, 0, fingerprint, key, len(token_ids), len(payload))
    crc = zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(header)))
    final = directory / file_name(key)
    temp = directory / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(temp, "wb") as f:
            f.write(header)
            f.write(tokens)
            f.write(payload)
            f.write(_TRAILER.pack(crc))
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return file_size(len(token_ids), len(payload))


def read_block(path: Path, fingerprint: bytes, key: bytes, token_ids: Sequence[int],
               payload_len: int) -> memoryview | None:
    """The payload of a block file if it is the block asked for, whole and intact; None otherwise
    (a torn, truncated or corrupt file, another block's, another fingerprint's). Raises OSError when the
    file cannot be read (gone: a miss too, for the caller)."""
    size = file_size(len(token_ids), payload_len)
    buf = bytearray(size + 1)               # one byte more: a longer file is caught by its length
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(buf)
    if got != size:
        return None
    view = memoryview(buf)
    magic, version, _, fp, file_key, num_tokens, length = _HEADER.unpack_from(view)
    if (magic, version, fp, file_key, num_tokens, length) != (MAGIC, FORMAT_VERSION, fingerprint, key,
                                                              len(token_ids), payload_len):
        return None
    end = size - _TRAILER.size
    if zlib.crc32(view[:end]) != _TRAILER.unpack_from(view, end)[0]:
        return None
    tokens = np.frombuffer(view[_HEADER.size:_HEADER.size + 4 * num_tokens], dtype="<i4")
    if tokens.tolist() != list(token_ids):
        return None
    return view[_HEADER.size + 4 * num_tokens:end]


def fingerprint(model_path: str, **layout: object) -> bytes:
    """What makes K/V differ, as a 16-byte digest: the model file (its size, its first 4 MiB, where the
    header and metadata are, and 64 KiB at 32 points through the rest: a fine-tune with the same metadata
    still differs) and `layout` (dtype, shapes, numerics, block size), with FORMAT_VERSION."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    size = os.path.getsize(model_path)
    h.update(f"forge-kv v{FORMAT_VERSION} {size} {sorted(layout.items())!r}".encode())
    with open(model_path, "rb") as f:
        h.update(f.read(4 << 20))
        for i in range(32):
            f.seek(size * i // 32)
            h.update(f.read(64 << 10))
    return h.digest()
