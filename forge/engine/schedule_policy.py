"""The scheduling policies (forge.config.SCHEDULING_POLICIES): the order in which a step's token
budget is handed out.

  "fcfs":           running sequences in admission order, then waiting ones in arrival order.
  "shortest-first": decode rows first, then prefills by fewest tokens left to compute, waiting
                    prompts by length (by what they still need to compute, with the prefix
                    estimate); a sequence AGING_STEPS steps after its arrival (and any preempted
                    one) goes before all other prefill work, oldest first.

Pure functions of the queues: the scheduler (forge.engine.scheduler) owns the state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from itertools import islice

from forge.engine.prefix_estimate import PrefixEstimate
from forge.engine.sequence import SeqState, Sequence

# Steps after its arrival from which a sequence is served in arrival order, whatever its length:
# the bound on how long shorter arrivals can keep overtaking it.
AGING_STEPS = 32


def is_aged(seq: Sequence, step: int) -> bool:
    return step - seq.arrival_step >= AGING_STEPS or seq.state is SeqState.PREEMPTED


def budget_order(policy: str, running: list[Sequence], step: int) -> list[Sequence]:
    """The running sequences in the order they take the step's budget."""
    if policy == "fcfs":
        return running

    def key(seq: Sequence) -> tuple[int, int, int]:
        left = seq.total_len() - seq.num_computed_tokens
        if left <= 1:
            return (0, seq.arrival_step, 0)                   # decode rows: one token each
        if is_aged(seq, step):
            return (1, seq.arrival_step, 0)
        return (2, left, seq.arrival_step)
    return sorted(running, key=key)


def admission_order(policy: str, waiting: Iterable[Sequence], limit: int, step: int,
                    prefixes: PrefixEstimate, running: list[Sequence]) -> list[Sequence]:
    """Up to `limit` waiting sequences, in the order the allocator should try to admit them."""
    if policy == "fcfs":
        return list(islice(waiting, limit))       # the head of the queue only: no copy of all of it a step
    waiting = list(waiting)
    if not prefixes.enabled:
        def plain(seq: Sequence) -> tuple[int, int, int]:
            return (0, seq.arrival_step, 0) if is_aged(seq, step) else (1, seq.total_len(), seq.arrival_step)
        return sorted(waiting, key=plain)[:limit]
    # Prompts that share a prefix no one has computed yet (a burst of requests behind one new
    # system prompt) are one job: the first of them computes the prefix, after which the others
    # cost only their tails. So each ranks by its uncached tokens shared out over the waiting
    # prompts with the same next block, and only one of them is admitted at a time: admitted
    # together, each would compute the same blocks.
    cached = {seq.id: prefixes.cached(seq) for seq in waiting}
    nexts = {seq.id: prefixes.next_uncached_block(seq, cached[seq.id]) for seq in waiting}
    sharers = Counter(h for h in nexts.values() if h is not None)

    def key(seq: Sequence) -> tuple[int, float, int]:
        if is_aged(seq, step):
            return (0, seq.arrival_step, 0)
        h = nexts[seq.id]
        need = seq.total_len() - cached[seq.id]
        return (1, need / sharers[h] if h is not None else need, seq.arrival_step)
    claimed = prefixes.blocks_in_prefill(running)
    out: list[Sequence] = []
    for seq in sorted(waiting, key=key):
        h = nexts[seq.id]
        if h is not None and h in claimed:
            continue                  # another sequence computes this block now: wait for it
        if h is not None:
            claimed.add(h)
        out.append(seq)
        if len(out) == limit:
            break
    return out
