"""Continuous batching: which sequences run this step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and recompute after preemption: every sequence
has `num_computed_tokens`, which catches up with its token count (prompt + output) by at most the
step's token budget. There are no phases. The scheduler never calls a model and never touches
the KV cache: it knows the cache only by its layout (block size, block count), proposes
(`propose`), the cache allocator grants (`allocate_step`), and the scheduler records the outcome
(`commit`). LocalScheduler owns a cache as well and does the three in one call (`schedule`), for
one-process use and the seed's API.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from forge.config import SCHEDULING_POLICIES, EngineConfig
from forge.errors import CapacityError
from forge.messages import AllocateStep, BlockAsk, StepAllocation
from forge.paged_cache import CacheLayout, PagedKVCache, SeqId, block_hash, salt_root
from forge.sequence import SeqState, Sequence, TokenId
from forge.speculative import CROWD, CROWDED_TOKENS, DRAFT_PLACEHOLDER, NGRAM_WINDOW, SpeculativeConfig, ngram_proposal
from forge.step_cost import StepCostModel

# Scheduling policies (SCHEDULING_POLICIES): the order in which the step's token budget is handed out.
#   "fcfs":           running sequences in admission order, then waiting ones in arrival order.
#   "shortest-first": decode rows first, then prefills by fewest tokens left to compute, waiting
#                     prompts by length; a sequence AGING_STEPS steps after its arrival (and any
#                     preempted one) goes before all other prefill work, oldest first.
# Steps after its arrival from which a sequence is served in arrival order, whatever its length:
# the bound on how long shorter arrivals can keep overtaking it.
AGING_STEPS = 32
# At most this many waiting sequences are offered to the allocator per step (it admits them in
# order while the step's budget and the free blocks last).
MAX_ADMIT_CANDIDATES = 16
# Under a step-time target, prompts still advance by at least this many tokens a step, however
# long the decode rows alone take: no prompt waits for ever.
MIN_PREFILL_TOKENS = 16


@dataclass(slots=True)
class ScheduledSeq:
    seq_id: SeqId
    start: int                    # first position computed this step
    num_tokens: int               # tokens computed this step
    block_ids: tuple[int, ...]
    samples: bool                 # the chunk reaches the end: this step yields its next token
    num_draft: int = 0            # draft tokens computed after it (Sequence.draft), to verify


@dataclass(slots=True)
class StepPlan:
    admitted: list[SeqId] = field(default_factory=list)
    decode_batch: list[SeqId] = field(default_factory=list)   # sequences that yield a token
    preempted: list[SeqId] = field(default_factory=list)
    finished: list[SeqId] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)

    def is_idle(self) -> bool:
        return not (self.admitted or self.decode_batch or self.preempted or self.finished
                    or self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = 8                     # most sequences running at once
    max_num_batched_tokens: int | None = None   # token budget per step; None: unlimited
    policy: str = "fcfs"                        # one of SCHEDULING_POLICIES
    # While sequences are decoding, size each step to about this many seconds (by the measured
    # cost of recent steps) so their next tokens are not held up by long prompt chunks; None: the
    # token budget alone. Prefill always advances by at least MIN_PREFILL_TOKENS a step.
    max_step_s: float | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_step_s is not None and self.max_step_s <= 0:
            raise ValueError("max_step_s must be positive")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")

    @classmethod
    def of(cls, engine: EngineConfig) -> SchedulerConfig:
        """The scheduling part of an engine's configuration."""
        return cls(max_batch_size=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                   policy=engine.scheduling_policy,
                   max_step_s=engine.max_step_ms / 1000 if engine.max_step_ms is not None else None,
                   speculative=SpeculativeConfig(engine.speculative, engine.num_speculative_tokens,
                                                 max_batch=engine.speculative_max_batch))


class Scheduler:
    """Plans steps for a cache it knows by its layout. Keeps state only for unfinished sequences."""

    def __init__(self, config: SchedulerConfig, layout: CacheLayout) -> None:
        self.config = config
        self.layout = layout
        self._seqs: dict[SeqId, Sequence] = {}
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._to_free: list[SeqId] = []         # blocks to give back before the next allocation
        self._retired: list[SeqId] = []         # finished since the last plan
        self._step = 0                          # proposals made so far (the clock of aging)
        # Shortest-first ranks a waiting prompt by the tokens it will compute, not its length: the
        # prompt blocks this scheduler has seen computed (an LRU no larger than the cache) estimate
        # what the allocator's prefix cache will find. An estimate for ordering only: the
        # allocator's lookup decides what is reused.
        self._prefix_index: OrderedDict[int, None] = OrderedDict()
        self._index_prefixes = config.policy == "shortest-first" and layout.enable_prefix_caching
        self.num_preemptions = 0
        self.cost = StepCostModel()

    # ---- queries ------------------------------------------------------------------------

    def waiting_len(self) -> int:
        return len(self._waiting)

    def running_len(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        """Sequences to run, or ended ones whose blocks or end are still to be given out."""
        return bool(self._waiting or self._running or self._to_free or self._retired)

    def tracked(self) -> dict[str, int]:
        """Sizes of the per-sequence tables: all zero once every sequence has ended and been freed.

        The prefix index is not per sequence: it is bounded by the cache's block count.
        """
        return {"scheduler.seqs": len(self._seqs), "scheduler.waiting": len(self._waiting),
                "scheduler.running": len(self._running), "scheduler.to_free": len(self._to_free),
                "scheduler.retired": len(self._retired)}

    def running_seq(self, seq_id: SeqId) -> Sequence | None:
        seq = self._seqs.get(seq_id)
        return seq if seq is not None and seq.state is SeqState.RUNNING else None

    def get(self, seq_id: SeqId) -> Sequence | None:
        return self._seqs.get(seq_id)

    # ---- commands -----------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence. One that could never fit in the whole cache is refused at once."""
        if seq.id in self._seqs:
            raise ValueError(f"sequence {seq.id} is already submitted")
        layout = self.layout
        worst = len(seq.prompt) + max(seq.max_new_tokens, 0)
        if -(-worst // layout.block_size) > layout.num_blocks:
            raise CapacityError(f"sequence {seq.id} needs {worst} tokens; the KV cache holds "
                                f"{layout.num_blocks * layout.block_size}")
        seq.state = SeqState.WAITING
        seq.arrival_step = self._step
        self._seqs[seq.id] = seq
        self._waiting.append(seq)

    def push_token(self, seq_id: SeqId, token: TokenId, is_eos: bool) -> None:
        """Record a generated token; on eos, cap the limit so the sequence retires next step."""
        seq = self._seqs[seq_id]
        seq.output.append(token)
        if is_eos:
            seq.max_new_tokens = len(seq.output)

    def finish(self, seq_id: SeqId) -> None:
        """Retire a sequence now (it met a stop condition the caller checks)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            seq.max_new_tokens = len(seq.output)
            self._retire(seq)

    def abort(self, seq_id: SeqId) -> bool:
        """Drop a sequence wherever it is; its blocks are freed before the next step."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self._retire(seq)
        return True

    def take_frees(self) -> list[SeqId]:
        out, self._to_free = self._to_free, []
        return out

    # ---- one step -----------------------------------------------------------------------

    def propose(self) -> AllocateStep:
        """Retire complete sequences, then share the step's token budget out by the policy.

        Running sequences get their share here; the budget left over goes to the allocator with
        the waiting candidates (in the policy's order), so that a prompt mostly found in the prefix
        cache costs the budget only its uncached tokens. The asks of running sequences stay in
        admission order: the allocator preempts from the end, the most recently admitted first.
        """
        for seq in [s for s in self._running if s.is_complete()]:
            self._retire(seq)
        self._step += 1
        budget = self._step_budget()
        shares: dict[SeqId, int] = {}
        decoding: list[Sequence] = []
        for seq in self._budget_order(self._running):
            left = seq.total_len() - seq.num_computed_tokens
            num = min(left, budget)
            budget -= num
            shares[seq.id] = num
            seq.draft = []
            if left == num == 1 and seq.lookahead is not None:
                decoding.append(seq)
        num_slots = min(self.config.max_batch_size - len(self._running), MAX_ADMIT_CANDIDATES)
        candidates = self._admission_order(num_slots) if budget > 0 and num_slots > 0 else []
        if decoding and self._speculates():
            # Guesses come last: only from budget no prompt can use this step (the running ones
            # had theirs above; the waiting candidates need their uncached tokens). A guess may be
            # rejected; a prompt token is work that must be done, and someone waits for its end.
            spare = budget - sum(seq.total_len() - self._estimated_cached(seq) for seq in candidates)
            most = CROWDED_TOKENS if len(decoding) > CROWD else None
            for seq in decoding:
                if spare <= 0:
                    break
                seq.draft = self._propose_draft(seq, spare if most is None else min(spare, most))
                spare -= len(seq.draft)
                budget -= len(seq.draft)
        asks = [self._ask(seq, shares[seq.id], is_running=True) for seq in self._running]
        if budget > 0:
            asks += [self._ask(seq, seq.total_len(), is_running=False) for seq in candidates]
        return AllocateStep(frees=tuple(self.take_frees()), asks=tuple(asks), admit_budget=budget)

    def _speculates(self) -> bool:
        """Whether this step's decode rows may carry drafts: speculation is on, and few enough
        sequences decode that a step is bound by reading the weights, not by arithmetic."""
        spec = self.config.speculative
        if not spec.enabled:
            return False
        decoding = sum(1 for s in self._running if s.total_len() - s.num_computed_tokens == 1)
        return 0 < decoding <= spec.max_batch

    def _propose_draft(self, seq: Sequence, budget: int) -> list[TokenId]:
        assert seq.lookahead is not None
        room = min(seq.max_new_tokens - len(seq.output) - 1, budget)      # drafts past the limit are waste
        if room <= 0:
            return []
        k = min(seq.lookahead.budget(), room)
        if k <= 0:
            return []
        spec = self.config.speculative
        if spec.method == "draft":                 # the model runner's draft model fills them in
            return [DRAFT_PLACEHOLDER] * k
        end = seq.total_len()                      # the window only: no copy of a long sequence per step
        return ngram_proposal(seq.tokens(max(0, end - NGRAM_WINDOW), end), k, max_ngram=spec.max_ngram,
                              min_ngram=spec.min_ngram)

    def accept_drafts(self, seq_id: SeqId, num_accepted: int) -> None:
        """The step kept `num_accepted` of the sequence's drafts (now output tokens): their K/V are
        computed; the rejected drafts' slots go back at the next allocation."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        if seq.lookahead is not None and seq.draft:
            seq.lookahead.observe(len(seq.draft), num_accepted)
        seq.num_computed_tokens += num_accepted
        seq.draft = []

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """What the last step cost: it teaches the step-time target's cost model."""
        self.cost.observe(num_tokens, seconds)

    def _step_budget(self) -> int:
        """The token budget, or under a step-time target with sequences decoding, what the cost
        model says fits the target: the decode rows plus at least MIN_PREFILL_TOKENS of prompt."""
        budget = self.config.max_num_batched_tokens or 1 << 62
        target = self.config.max_step_s
        if target is None:
            return budget
        num_decoding = sum(1 for s in self._running if s.total_len() - s.num_computed_tokens <= 1)
        fits = self.cost.tokens_within(target) if num_decoding else None
        if fits is None:
            return budget           # nothing decoding (prefill may take it all), or no fit yet
        return min(budget, max(fits, num_decoding + MIN_PREFILL_TOKENS))

    def _is_aged(self, seq: Sequence) -> bool:
        return self._step - seq.arrival_step >= AGING_STEPS or seq.state is SeqState.PREEMPTED

    def _budget_order(self, running: list[Sequence]) -> list[Sequence]:
        if self.config.policy == "fcfs":
            return running

        def key(seq: Sequence) -> tuple[int, int, int]:
            left = seq.total_len() - seq.num_computed_tokens
            if left <= 1:
                return (0, seq.arrival_step, 0)                   # decode rows: one token each
            if self._is_aged(seq):
                return (1, seq.arrival_step, 0)
            return (2, left, seq.arrival_step)
        return sorted(running, key=key)

    def _admission_order(self, limit: int) -> list[Sequence]:
        if self.config.policy == "fcfs":
            return [self._waiting[i] for i in range(min(limit, len(self._waiting)))]

        if not self._index_prefixes:
            def plain(seq: Sequence) -> tuple[int, int, int]:
                return (0, seq.arrival_step, 0) if self._is_aged(seq) else (1, seq.total_len(), seq.arrival_step)
            return sorted(self._waiting, key=plain)[:limit]
        # Prompts that share a prefix no one has computed yet (a burst of requests behind one new
        # system prompt) are one job: the first of them computes the prefix, after which the others
        # cost only their tails. So each ranks by its uncached tokens shared out over the waiting
        # prompts with the same next block, and only one of them is admitted at a time: admitted
        # together, each would compute the same blocks.
        cached = {seq.id: self._estimated_cached(seq) for seq in self._waiting}
        nexts = {seq.id: self._next_uncached_block(seq, cached[seq.id]) for seq in self._waiting}
        sharers = Counter(h for h in nexts.values() if h is not None)

        def key(seq: Sequence) -> tuple[int, float, int]:
            if self._is_aged(seq):
                return (0, seq.arrival_step, 0)
            h = nexts[seq.id]
            need = seq.total_len() - cached[seq.id]
            return (1, need / sharers[h] if h is not None else need, seq.arrival_step)
        claimed = self._blocks_in_prefill()
        out: list[Sequence] = []
        for seq in sorted(self._waiting, key=key):
            h = nexts[seq.id]
            if h is not None and h in claimed:
                continue                  # another sequence computes this block now: wait for it
            if h is not None:
                claimed.add(h)
            out.append(seq)
            if len(out) == limit:
                break
        return out

    def _next_uncached_block(self, seq: Sequence, num_cached: int) -> int | None:
        """The hash of the first prompt block the prefix cache likely lacks (past its `num_cached`
        tokens); None when what is left is less than a block (nothing another prompt could share)."""
        hashes = self._prompt_hashes(seq)[: (len(seq.prompt) - 1) // self.layout.block_size]
        num = num_cached // self.layout.block_size
        return hashes[num] if num < len(hashes) else None

    def _blocks_in_prefill(self) -> set[int]:
        """Hashes of the prompt blocks running sequences have yet to compute."""
        bs, out = self.layout.block_size, set()
        for seq in self._running:
            if seq.num_computed_tokens < len(seq.prompt):
                out.update(self._prompt_hashes(seq)[seq.num_computed_tokens // bs:])
        return out

    def _prompt_hashes(self, seq: Sequence) -> list[int]:
        if seq.prompt_hashes is None:
            bs, parent, hashes = self.layout.block_size, salt_root(seq.cache_salt), []
            for i in range(len(seq.prompt) // bs):
                parent = block_hash(parent, tuple(seq.prompt[i * bs:(i + 1) * bs]))
                hashes.append(parent)
            seq.prompt_hashes = hashes
        return seq.prompt_hashes

    def _estimated_cached(self, seq: Sequence) -> int:
        """Leading prompt tokens the prefix cache likely holds (always one token short of the
        prompt, as the allocator leaves the last one to compute)."""
        if not self._index_prefixes:
            return 0
        bs = self.layout.block_size
        hashes = self._prompt_hashes(seq)[: (len(seq.prompt) - 1) // bs]
        num = 0
        while num < len(hashes) and hashes[num] in self._prefix_index:
            num += 1
        return num * bs

    def _index_computed(self, seq: Sequence) -> None:
        hashes = self._prompt_hashes(seq)
        full = min(seq.num_computed_tokens // self.layout.block_size, len(hashes))
        for h in hashes[seq.num_indexed_blocks:full]:
            self._prefix_index[h] = None
            self._prefix_index.move_to_end(h)
        seq.num_indexed_blocks = max(seq.num_indexed_blocks, full)
        while len(self._prefix_index) > self.layout.num_blocks:
            self._prefix_index.popitem(last=False)

    def commit(self, alloc: StepAllocation) -> StepPlan:
        plan = StepPlan(finished=self._retired)
        self._retired = []
        for seq_id in alloc.preempted:
            self._preempt(self._seqs[seq_id])
            plan.preempted.append(seq_id)
        for grant in alloc.grants:
            seq = self._seqs[grant.seq_id]
            if seq.state is not SeqState.RUNNING:
                self._waiting.remove(seq)
                self._running.append(seq)
                seq.state = SeqState.RUNNING
                seq.num_cached_tokens = grant.num_cached
                plan.admitted.append(seq.id)
            seq.num_tokens_sent = seq.total_len()
            seq.num_computed_tokens = grant.start + grant.num_tokens
            if self._index_prefixes:
                self._index_computed(seq)
            if grant.num_tokens == 0:
                seq.draft = []
                continue
            samples = seq.num_computed_tokens == seq.total_len()
            seq.draft = seq.draft[: grant.num_lookahead] if samples else []
            plan.scheduled.append(ScheduledSeq(seq.id, grant.start, grant.num_tokens,
                                               grant.block_ids, samples, len(seq.draft)))
            if samples:
                plan.decode_batch.append(seq.id)
        return plan

    # ---- internals ----------------------------------------------------------------------

    def _ask(self, seq: Sequence, num: int, *, is_running: bool) -> BlockAsk:
        sent = seq.num_tokens_sent if is_running else 0
        new_ids = tuple(seq.tokens(sent, seq.total_len()))
        if not is_running:
            return BlockAsk(seq_id=seq.id, new_token_ids=new_ids, max_compute=num, is_running=False,
                            cache_salt=seq.cache_salt)
        return BlockAsk(seq_id=seq.id, new_token_ids=new_ids, max_compute=num, is_running=True,
                        num_computed=seq.num_computed_tokens, num_lookahead=len(seq.draft))

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        seq.state = SeqState.PREEMPTED
        seq.num_computed_tokens = 0
        seq.num_tokens_sent = 0
        seq.draft = []
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    def _retire(self, seq: Sequence) -> None:
        if seq.state is SeqState.RUNNING:
            self._running.remove(seq)
            self._to_free.append(seq.id)
        elif seq.state in (SeqState.WAITING, SeqState.PREEMPTED):
            self._waiting.remove(seq)
        seq.state = SeqState.FINISHED
        del self._seqs[seq.id]
        self._retired.append(seq.id)


class LocalScheduler(Scheduler):
    """A scheduler that owns its cache too, for one process (the seed's Scheduler::new(config, cache)).

    In the daemon the two are apart: the cache allocator actor owns the cache and the scheduler
    actor's Scheduler sees only its layout.
    """

    def __init__(self, config: SchedulerConfig, cache: PagedKVCache) -> None:
        super().__init__(config, cache.layout())
        self._cache = cache

    def cache(self) -> PagedKVCache:
        return self._cache

    def schedule(self) -> StepPlan:
        """Plan one step against the local cache: propose, allocate, commit."""
        step = self.propose()
        for seq_id in step.frees:
            self._cache.free(seq_id)
        return self.commit(self._cache.allocate_step(step.asks, step.admit_budget))

    def take_finished(self) -> list[SeqId]:
        """Always empty, as in the seed: finished sequences are reported by StepPlan.finished.

        Kept for the seed's engine loop; a list that nothing drains would grow for ever.
        """
        return []
