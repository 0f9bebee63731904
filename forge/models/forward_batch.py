"""The hand-off between the scheduler side and the model: one step's flattened tokens.

A step runs every scheduled sequence at once. Sequence s contributes the query tokens
token_ids[query_start[s]:query_start[s+1]], at the positions just before context_lens[s]
(context_lens counts the tokens in the KV cache *after* this step), built from the step's
chunks by build_forward_batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from forge.messages import SeqChunk

I64 = npt.NDArray[np.int64]


@dataclass(slots=True)
class ForwardBatch:
    token_ids: I64        # [T]      flattened query tokens of all sequences
    positions: I64        # [T]      position of each token in its sequence
    slot_mapping: I64     # [T]      block_id * block_size + offset where its K/V go
    query_start: I64      # [S + 1]  cu-seqlens of the query tokens
    context_lens: I64     # [S]      tokens in the KV cache after this step
    block_tables: I64     # [S, B]   block ids per sequence, padded with 0
    sample_indices: I64   # [N]      rows of T whose logits are returned, in order

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


def build_forward_batch(chunks: tuple[SeqChunk, ...], block_size: int) -> ForwardBatch:
    """Flatten the chunks of one step; positions and slots come from starts and block tables."""
    num_seqs = len(chunks)
    lens = np.fromiter((len(c.token_ids) for c in chunks), np.int64, num_seqs)     # [S]
    starts = np.fromiter((c.start for c in chunks), np.int64, num_seqs)            # [S]
    query_start = np.zeros(num_seqs + 1, np.int64)                                 # [S + 1]
    np.cumsum(lens, out=query_start[1:])
    num_tokens = int(query_start[-1])
    token_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks),
                            np.int64, num_tokens)                                  # [T]
    seq_of_token = np.repeat(np.arange(num_seqs), lens)                            # [T]
    positions = np.arange(num_tokens) + np.repeat(starts - query_start[:-1], lens)  # [T]
    max_blocks = max(len(c.block_ids) for c in chunks)
    block_tables = np.zeros((num_seqs, max_blocks), np.int64)                      # [S, B]
    for i, c in enumerate(chunks):
        block_tables[i, : len(c.block_ids)] = c.block_ids
    slot_mapping = (block_tables[seq_of_token, positions // block_size] * block_size
                    + positions % block_size)                                      # [T]
    # The rows that sample: a chunk's last, and before it one per draft token (each verifies the next).
    num_rows = np.fromiter(((c.num_draft + 1) if c.samples else 0 for c in chunks), np.int64, num_seqs)  # [S]
    ends = np.repeat(query_start[1:], num_rows)                                    # [R]
    back = np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    sample_indices = ends - np.repeat(num_rows, num_rows) + back                   # [R]
    return ForwardBatch(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                        query_start=query_start, context_lens=starts + lens,
                        block_tables=block_tables, sample_indices=sample_indices)
