"""Continuous batching: which sequences run this step, and how many tokens each computes.

One rule covers prefill, chunked prefill, decode and recompute after preemption: every sequence
has `num_computed_tokens`, which catches up with its token count (prompt + output) by at most the
step's token budget. There are no phases. The scheduler never calls a model and never touches
the KV cache: it knows the cache only by its layout (block size, block count), proposes
(`propose`), the cache allocator grants (`BlockAllocator.allocate_step`), and the scheduler
records the outcome (`commit`). The order of the budget is the policy's (forge.engine.schedule_policy),
the prefix estimate ranks waiting prompts (forge.engine.prefix_estimate), and speculation takes only
what is left (forge.spec_decode.draft_budget).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from forge.config import SCHEDULING_POLICIES, EngineConfig
from forge.engine.block_table import CacheLayout, SeqId
from forge.engine.fair_share import FairShare, is_mixed
from forge.engine.prefix_estimate import PrefixEstimate
from forge.engine.schedule_policy import admission_order, budget_order
from forge.engine.sequence import SeqState, Sequence, TokenId
from forge.engine.step_cost import StepCostModel
from forge.errors import CapacityError
from forge.messages import AllocateStep, BlockAsk, StepAllocation
from forge.spec_decode import draft_budget
from forge.spec_decode.speculation import SpeculativeConfig

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
    preempted: list[SeqId] = field(default_factory=list)
    finished: list[SeqId] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 8                       # most sequences running at once
    max_num_batched_tokens: int | None = None   # token budget per step; None: unlimited
    policy: str = "fcfs"                        # one of SCHEDULING_POLICIES
    # While sequences are decoding, size each step to about this many seconds (by the measured
    # cost of recent steps) so their next tokens are not held up by long prompt chunks; None: the
    # token budget alone. Prefill always advances by at least MIN_PREFILL_TOKENS a step.
    max_step_s: float | None = None
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_step_s is not None and self.max_step_s <= 0:
            raise ValueError("max_step_s must be positive")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")

    @classmethod
    def of(cls, engine: EngineConfig) -> SchedulerConfig:
        """The scheduling part of an engine's configuration."""
        return cls(max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
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
        self._prefixes = PrefixEstimate(
            layout, enabled=config.policy == "shortest-first" and layout.enable_prefix_caching)
        self.num_preemptions = 0
        self.num_fair_preemptions = 0           # of those, to give a tenant under its share a slot
        self.cost = StepCostModel()
        self.fair = FairShare()                 # tenants' recent service (forge.engine.fair_share)
        self._head_asked: SeqId | None = None   # the first waiting sequence offered to the last allocation
        self._head_blocked: SeqId | None = None  # it, when the allocation refused it for want of blocks
        self._last_solo = False                 # the last step was a prefill step of its own (`_solo_prefill`)
        self.num_solo_prefills = 0              # such steps so far
        self._free_blocks = layout.num_blocks   # free at the end of the last allocation

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

    def push_token(self, seq_id: SeqId, token: TokenId) -> None:
        """Record a generated token (its stop rules are the caller's: `finish`)."""
        self._seqs[seq_id].output.append(token)

    def finish(self, seq_id: SeqId) -> None:
        """Retire a sequence now (it met a stop condition the caller checks)."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
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
        self.fair.tick()
        if not self._preempt_for_priority():
            self._preempt_for_fairness()
        num_slots = min(self.config.max_num_seqs - len(self._running), MAX_ADMIT_CANDIDATES)
        solo = self._solo_prefill(budget, num_slots)
        self._last_solo = bool(solo)
        self.num_solo_prefills += bool(solo)
        for seq in self._by_priority(budget_order(self.config.policy, self._running, self._step)):
            left = seq.total_len() - seq.num_computed_tokens
            num = 0 if solo else min(left, budget)
            budget -= num
            shares[seq.id] = num
            seq.draft = []
            if left == num == 1 and seq.lookahead is not None:
                decoding.append(seq)
        candidates = solo or (self._candidates(num_slots) if budget > 0 and num_slots > 0 else [])
        if decoding and draft_budget.speculates(self.config.speculative, self._running):
            # Guesses come last: only from budget no prompt can use this step (the running ones
            # had theirs above; the waiting candidates need their uncached tokens).
            spare = budget - sum(seq.total_len() - self._prefixes.cached(seq) for seq in candidates)
            budget -= draft_budget.hand_out(self.config.speculative, decoding, spare)
        # The allocator preempts from the end of the running asks: the least urgent priority, and within it
        # the most recently admitted, gives its blocks up first.
        asks = [self._ask(seq, shares[seq.id], is_running=True) for seq in self._by_priority(self._running)]
        self._head_asked = candidates[0].id if budget > 0 and candidates else None
        if budget > 0:
            asks += [self._ask(seq, seq.total_len(), is_running=False) for seq in candidates]
        return AllocateStep(frees=tuple(self.take_frees()), asks=tuple(asks), admit_budget=budget)

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

    def commit(self, alloc: StepAllocation) -> StepPlan:
        plan = StepPlan(finished=self._retired)
        self._retired = []
        self._note_blocked_head(alloc)
        self._free_blocks = alloc.num_free_blocks
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
                seq.admitted_step = self._step
            seq.num_tokens_sent = seq.total_len()
            seq.num_computed_tokens = grant.start + grant.num_tokens
            self.fair.charge(seq, grant.num_tokens)
            self._prefixes.computed(seq)
            if grant.num_tokens == 0:
                seq.draft = []
                continue
            samples = seq.num_computed_tokens == seq.total_len()
            seq.draft = seq.draft[: grant.num_lookahead] if samples else []
            plan.scheduled.append(ScheduledSeq(seq.id, grant.start, grant.num_tokens,
                                               grant.block_ids, samples, len(seq.draft)))
        return plan

    # ---- internals ----------------------------------------------------------------------

    def _candidates(self, limit: int) -> list[Sequence]:
        """Up to `limit` waiting sequences in the order the allocator should try them: the policy's, unless
        they differ in priority or tenant, when forge.engine.fair_share orders the policy's ranking."""
        args = (self.config.policy, self._waiting)
        if not is_mixed(self._waiting):
            return admission_order(*args, limit, self._step, self._prefixes, self._running)
        ranked = admission_order(*args, len(self._waiting), self._step, self._prefixes, self._running)
        return self.fair.order(ranked, limit, self._running)

    def _solo_prefill(self, budget: int, num_slots: int) -> list[Sequence]:
        """The waiting sequences that get this step to themselves, the running ones computing nothing in it: the
        next turns (`_candidates`) while each is of a tenant under its share (FairShare.is_under_share: fewer
        running sequences for its share than another tenant that has had more service, or more urgent than
        every running sequence) and its whole prompt fits the step's budget and the blocks the last allocation
        left free (it yields its first token at the end of this step). A short prompt's first token then waits
        for its own prefill alone, not for the running sequences' rows and their drafts. Never two such steps in
        a row: the running sequences advance at least every other step. Empty (an ordinary step) otherwise, and
        always with one tenant."""
        if self._last_solo or num_slots <= 0 or not self._running or not self._waiting:
            return []
        tenants = {s.tenant for s in self._running}
        if len(tenants) == 1 and all(s.tenant in tenants for s in self._waiting):
            return []
        out: list[Sequence] = []
        free = self._free_blocks          # as the last allocation left them: its blocks must be there
        for seq in self._candidates(num_slots):
            need, blocks = seq.total_len() - self._prefixes.cached(seq), -(-seq.total_len() // self.layout.block_size)
            if need > budget or blocks > free or not self.fair.is_under_share(seq, self._running):
                break
            budget, free = budget - need, free - blocks
            out.append(seq)
        return out

    def _preempt_for_priority(self) -> bool:
        """Every slot taken and a sequence waiting that is more urgent than the least urgent running one: that
        one gives up its slot and blocks (freed with this step's frees) and waits to be recomputed, as vLLM's
        priority scheduling preempts. One a step: the freed slot goes to the most urgent waiting."""
        if len(self._running) < self.config.max_num_seqs or not self._waiting:
            return False
        victim = self._by_priority(self._running)[-1]
        if victim.priority <= min(s.priority for s in self._waiting):
            return False
        self._preempt(victim)
        self._to_free.append(victim.id)
        return True

    def _preempt_for_fairness(self) -> None:
        """Every slot taken, or the blocks too few for the next turn (`_candidates`) at the last allocation, and
        that turn is of a tenant under its share, at a priority no running sequence is less urgent than: a
        sequence of the tenant furthest over its share gives its slot and blocks up to it (FairShare.victim says
        which, and when not). One a step; with one tenant, never."""
        is_full = len(self._running) >= self.config.max_num_seqs
        if not self._waiting or not self._running or not (is_full or self._head_blocked is not None):
            return
        tenants = {s.tenant for s in self._running}
        if len(tenants) == 1 and all(s.tenant in tenants for s in self._waiting):
            return
        heads = self._candidates(1)
        if not heads or not (is_full or heads[0].id == self._head_blocked):
            return
        victim = self.fair.victim(self._running, heads[0], self._step)
        if victim is not None:
            self._preempt(victim)
            self._to_free.append(victim.id)
            self.num_fair_preemptions += 1

    def _note_blocked_head(self, alloc: StepAllocation) -> None:
        """Whether the allocation refused the first waiting sequence offered for want of blocks: nothing was
        preempted (which stops admission), it got no grant, and the blocks left could not hold its tokens (a
        prompt whose blocks the disk tier is still loading is refused with blocks to spare)."""
        head, self._head_asked, self._head_blocked = self._head_asked, None, None
        seq = self._seqs.get(head) if head is not None and not alloc.preempted else None
        if seq is None or any(grant.seq_id == head for grant in alloc.grants):
            return
        if alloc.num_free_blocks * self.layout.block_size < seq.total_len():
            self._head_blocked = head

    @staticmethod
    def _by_priority(seqs: list[Sequence]) -> list[Sequence]:
        """`seqs` in the same order, stably sorted by priority (most urgent first) when they differ."""
        return sorted(seqs, key=lambda s: s.priority) if any(s.priority != seqs[0].priority for s in seqs) else seqs

    def _ask(self, seq: Sequence, num: int, *, is_running: bool) -> BlockAsk:
        sent = seq.num_tokens_sent if is_running else 0
        new_ids = tuple(seq.tokens(sent, seq.total_len()))
        if not is_running:
            return BlockAsk(seq_id=seq.id, new_token_ids=new_ids, max_compute=num, is_running=False,
                            cache_salt=seq.cache_salt, use_prefix_cache=not seq.reads_all_states)
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
