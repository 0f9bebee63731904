"""The disk tier's files and its round trip through a real BlockAllocator: a block file reads back exactly
what was written, and any damage to it (a flipped byte, a cut, another block's tokens or another layout's
fingerprint) is a miss, never other K/V; blocks the cache forgets come back, bit for bit, for a prompt
that misses in RAM; the directory stays within its size; a second tier on one directory is refused."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.engine import block_files as bf
from forge.engine.block_allocator import BlockAllocator
from forge.engine.disk_tier import DiskTier
from forge.messages import BlockAsk

FP = bytes(range(16))                 # a fingerprint (block_files.fingerprint digests a model file)
BS = 4


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=32), payload=st.binary(max_size=4096),
       flip=st.integers(min_value=0), cut=st.integers(min_value=0))
def test_a_block_file_reads_back_and_any_damage_is_a_miss(tmp_path_factory: pytest.TempPathFactory, tokens: list[int],
                                                          payload: bytes, flip: int, cut: int) -> None:
    directory = tmp_path_factory.mktemp("blocks")
    key = bf.chain_key(bf.root_key(None), tokens)
    size = bf.write_block(directory, FP, key, tokens, payload)
    path = directory / bf.file_name(key)
    assert path.stat().st_size == size == bf.file_size(len(tokens), len(payload))
    assert bf.key_of(path.name) == key
    read = bf.read_block(path, FP, key, tokens, len(payload))
    assert read is not None and bytes(read) == payload
    assert bf.read_block(path, b"x" * 16, key, tokens, len(payload)) is None            # another fingerprint
    assert bf.read_block(path, FP, key, [*tokens[:-1], tokens[-1] ^ 1], len(payload)) is None
    assert bf.read_block(path, FP, bytes(16), tokens, len(payload)) is None             # another block's
    data = bytearray(path.read_bytes())
    data[flip % len(data)] ^= 1 << (flip % 8)
    path.write_bytes(bytes(data))
    assert bf.read_block(path, FP, key, tokens, len(payload)) is None
    path.write_bytes(bytes(data[:cut % len(data)]))
    assert bf.read_block(path, FP, key, tokens, len(payload)) is None


def test_keys_chain_the_prefix_and_the_salt() -> None:
    a = bf.prefix_keys(list(range(12)), BS, None, 3)
    assert a == bf.prefix_keys(list(range(12)), BS, None, 3) and len(set(a)) == 3
    assert bf.prefix_keys([9, *range(1, 12)], BS, None, 3)[2] != a[2]     # an earlier token differs
    assert bf.prefix_keys(list(range(12)), BS, "tenant", 3)[0] != a[0]
    assert bf.key_of("x" * 32 + bf.SUFFIX) is None and bf.key_of("lock") is None


def make(tmp_path: Path, num_blocks: int = 8, max_bytes: int = 1 << 20) -> tuple[BlockAllocator, list[np.ndarray],
                                                                                  DiskTier]:
    arrays = [np.zeros((2, num_blocks, BS, 3), np.float16) for _ in range(2)]
    alloc = BlockAllocator(num_blocks, BS, enable_prefix_caching=True)
    tier = DiskTier.open(str(tmp_path), FP, max_bytes, arrays, BS, warn=lambda m: None)
    assert tier is not None
    alloc.tier = tier
    return alloc, arrays, tier


def run(alloc: BlockAllocator, seq: int, tokens: list[int], arrays: list[np.ndarray],
        tier: DiskTier) -> tuple[int, tuple[int, ...]]:
    """Admit `tokens` as `seq` (waiting while its blocks load), fill the K/V it computes with a function of
    each slot's token and position, finish it; returns the tokens found cached and its blocks."""
    while True:
        step = alloc.allocate_step([BlockAsk(seq_id=seq, new_token_ids=tuple(tokens), max_compute=len(tokens),
                                             is_running=False)])
        if step.grants:
            break
        tier.wait_loads(1.0)
    grant = step.grants[0]
    for pos in range(grant.start, grant.start + grant.num_tokens):
        block, offset = grant.block_ids[pos // BS], pos % BS
        for a in arrays:
            a[:, block, offset] = tokens[pos] + pos / 100
    alloc.commit_computed(seq)
    alloc.free(seq)
    return grant.num_cached, grant.block_ids


def written(tier: DiskTier, num: int) -> None:
    while tier.stats().files < num:
        time.sleep(0.01)


def test_forgotten_blocks_come_back_from_disk_bit_for_bit(tmp_path: Path) -> None:
    alloc, arrays, tier = make(tmp_path)
    prompt = list(range(100, 117))                 # 4 full blocks and one token
    cached, blocks = run(alloc, 1, prompt, arrays, tier)
    assert cached == 0
    expected = [a[:, list(blocks[:4])].copy() for a in arrays]
    assert run(alloc, 2, list(range(200, 232)), arrays, tier)[0] == 0   # 8 blocks: the cached ones are forgotten
    written(tier, 4)
    cached, blocks = run(alloc, 3, prompt, arrays, tier)
    assert cached == 16
    stats = tier.stats()
    assert stats.hit_blocks == 4 and stats.bytes_read == 4 * tier.payload_len
    for a, want in zip(arrays, expected, strict=True):
        assert np.array_equal(a[:, list(blocks[:4])], want)
    tier.close()


def test_a_corrupt_file_is_a_miss_and_goes(tmp_path: Path) -> None:
    alloc, arrays, tier = make(tmp_path)
    prompt = list(range(100, 117))
    run(alloc, 1, prompt, arrays, tier)
    run(alloc, 2, list(range(200, 232)), arrays, tier)
    written(tier, 4)
    first = tier.directory / bf.file_name(bf.prefix_keys(prompt, BS, None, 1)[0])
    data = bytearray(first.read_bytes())
    data[-10] ^= 0xFF
    first.write_bytes(bytes(data))
    assert run(alloc, 3, prompt, arrays, tier)[0] == 0
    assert tier.stats().bad_files == 1 and not first.exists()
    tier.close()


def test_the_directory_stays_within_its_size_and_is_held_by_one(tmp_path: Path) -> None:
    alloc, arrays, tier = make(tmp_path, max_bytes=3 * bf.file_size(BS, 2 * 2 * BS * 3 * 2))
    run(alloc, 1, list(range(100, 132)), arrays, tier)           # 8 full blocks
    run(alloc, 2, list(range(200, 232)), arrays, tier)           # forgets them all
    tier.write_out(alloc)
    assert DiskTier.open(str(tmp_path), FP, 1 << 20, arrays, BS, warn=lambda m: None) is None
    tier.close()
    assert tier.stats().files == 3 and len(list(tier.directory.glob("*.kvb"))) == 3
    again = DiskTier.open(str(tmp_path), FP, 1 << 20, arrays, BS, warn=lambda m: None)
    assert again is not None and again.stats().files == 3        # the index from the names alone
    again.close()


def test_leftovers_of_a_killed_writer_go_at_start(tmp_path: Path) -> None:
    alloc, arrays, tier = make(tmp_path)
    run(alloc, 1, list(range(100, 117)), arrays, tier)
    tier.write_out(alloc)
    tier.close()
    good = sorted(tier.directory.glob("*.kvb"))
    assert len(good) == 4
    (tier.directory / f".{good[0].name}.123.456.tmp").write_bytes(b"half a block")   # kill -9 mid-write
    with open(good[1], "r+b") as f:                                                  # a torn file
        f.truncate(10)
    again = DiskTier.open(str(tmp_path), FP, 1 << 20, arrays, BS, warn=lambda m: None)
    assert again is not None and again.stats().files == 3
    kept = sorted(p.name for p in again.directory.iterdir())
    assert kept == sorted(["lock", good[0].name, *(p.name for p in good[2:])])
    again.close()


def test_a_failed_write_turns_the_tier_off_once_and_allocation_goes_on(tmp_path: Path) -> None:
    warnings: list[str] = []
    arrays = [np.zeros((2, 8, BS, 3), np.float16) for _ in range(2)]
    alloc = BlockAllocator(8, BS, enable_prefix_caching=True)
    tier = DiskTier.open(str(tmp_path), FP, 1 << 20, arrays, BS, warn=warnings.append)
    assert tier is not None
    alloc.tier = tier
    for path in tier.directory.iterdir():
        path.unlink()
    tier.directory.rmdir()                          # the disk went away (full, read-only, unmounted)
    for n in range(4):
        run(alloc, n, [n * 1000 + i for i in range(32)], arrays, tier)   # each forgets the last one's blocks
    tier.close()
    assert not tier.enabled and len(warnings) == 1 and "off" in warnings[0]
    assert run(alloc, 9, list(range(32)), arrays, tier)[0] == 0           # the cache serves on without it
