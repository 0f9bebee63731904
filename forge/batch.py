"""The hand-off between the scheduler side and the model: one step's flattened tokens.

A step runs every scheduled sequence at once. Sequence s contributes the query tokens
token_ids[query_start[s]:query_start[s+1]], at the positions just before context_lens[s]
(context_lens counts the tokens in the KV cache *after* this step). Nothing here does work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

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
