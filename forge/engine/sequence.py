"""A sequence as the scheduler sees it: its prompt, its output so far, and how far its K/V is computed.

Mutable, owned by one scheduler; the allocator and the model never see it (they get ids and
token ids in messages).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from forge.engine.block_table import SeqId
from forge.spec_decode.speculation import Lookahead

TokenId = int


class SeqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    id: SeqId
    prompt: list[TokenId]
    output: list[TokenId] = field(default_factory=list)
    max_new_tokens: int = 16
    state: SeqState = SeqState.WAITING
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    num_tokens_sent: int = 0         # tokens the allocator knows (for prefix hashing)
    num_cached_tokens: int = 0       # prompt tokens found in the prefix cache at admission
    arrival_step: int = 0            # the scheduler's step count when it was submitted
    admitted_step: int = 0           # the step it last started running (forge.engine.fair_share.MIN_RUN_STEPS)
    prompt_hashes: list[int] | None = None  # prefix-cache keys of the prompt's full blocks (shortest-first)
    num_indexed_blocks: int = 0      # of those, how many the scheduler has seen computed
    lookahead: Lookahead | None = None  # speculation state; None: this sequence never speculates
    draft: list[TokenId] = field(default_factory=list)  # draft tokens proposed for this step
    cache_salt: str | None = None    # prefix-cache isolation (forge.engine.block_table.salt_root)
    reads_all_states: bool = False   # reads every token's state (a mean pooling, prompt logprobs): no prefix-cache hit
    priority: int = 0                # lower is admitted first (forge.engine.fair_share)
    tenant: str | None = None        # whose request it is; None: no tenant named
    share: float = 1.0               # its tenant's weight among the tenants of one priority

    def __init__(self, id: SeqId, prompt: list[TokenId], max_new_tokens: int) -> None:
        self.id = id
        self.prompt = list(prompt)
        self.output = []
        self.max_new_tokens = max_new_tokens
        self.state = SeqState.WAITING
        self.num_computed_tokens = 0
        self.num_tokens_sent = 0
        self.num_cached_tokens = 0
        self.arrival_step = 0
        self.admitted_step = 0
        self.prompt_hashes = None
        self.num_indexed_blocks = 0
        self.lookahead = None
        self.draft = []
        self.cache_salt = None
        self.reads_all_states = False
        self.priority = 0
        self.tenant = None
        self.share = 1.0

    def total_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def is_complete(self) -> bool:
        """Retired (its limit, a stop, an abort), or at its token limit: either way it takes no more steps."""
        return self.state is SeqState.FINISHED or len(self.output) >= self.max_new_tokens

    def token_at(self, i: int) -> TokenId:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def tokens(self, start: int, stop: int) -> list[TokenId]:
        n = len(self.prompt)
        if stop <= n:
            return self.prompt[start:stop]
        if start >= n:
            return self.output[start - n:stop - n]
        return self.prompt[start:] + self.output[:stop - n]
