"""Priorities and fair turns between tenants: the order in which waiting sequences are offered for admission.

A sequence carries a priority (lower is more urgent, vLLM's meaning) and a tenant (None is a tenant too,
the one of every request that names none) with its share. Waiting sequences are admitted by priority
first; within a priority, the tenant with the fewest running sequences for its share goes next, and among
equals the one that has received the least service for its share, so a tenant with 64 queued sequences does
not starve one with 1. Service is the tokens scheduled for a tenant's sequences, divided by its share and
decayed every step (a half-life of HALF_LIFE_STEPS), so it measures recent use, not all-time use. Inside one
tenant the scheduling policy's order stands (forge.engine.schedule_policy). When every slot is taken, the next
turn may take one from the tenant furthest over its share (`FairShare.victim`).

Pure bookkeeping for the scheduler (forge.engine.scheduler), which owns the sequences.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence as Seq

from forge.engine.sequence import Sequence

HALF_LIFE_STEPS = 64
_DECAY = 0.5 ** (1 / HALF_LIFE_STEPS)
_FORGET_BELOW = 1e-3              # service this small is forgotten (the table holds recent tenants only)
# Steps a sequence runs after its admission before fairness may preempt it: a preempted sequence, admitted
# again, is not the next one to give its slot up, and a preemption always buys some progress.
MIN_RUN_STEPS = 8


def is_mixed(waiting: Seq[Sequence]) -> bool:
    """Whether the waiting sequences differ in priority or tenant (only then is there an order to choose)."""
    if not waiting:
        return False
    first = waiting[0]
    return any(s.priority != first.priority or s.tenant != first.tenant for s in waiting)


class FairShare:
    """Each tenant's recent service; orders candidates by priority, then by least service for the share."""

    def __init__(self) -> None:
        self.service: dict[str | None, float] = {}

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """`num_tokens` scheduled for `seq` this step."""
        if num_tokens > 0:
            self.service[seq.tenant] = self.service.get(seq.tenant, 0.0) + num_tokens / seq.share

    def tick(self) -> None:
        """One step has passed: every tenant's service decays."""
        for tenant in list(self.service):
            value = self.service[tenant] * _DECAY
            if value < _FORGET_BELOW:
                del self.service[tenant]
            else:
                self.service[tenant] = value

    def order(self, ranked: list[Sequence], limit: int, running: Seq[Sequence] = ()) -> list[Sequence]:
        """Up to `limit` of `ranked` (the policy's order): by priority, then turn by turn to the tenant with the
        fewest sequences for its share (those `running` at that priority and the turns it was given here), and
        among equals to the one with the least service for its share, each turn counted as the tokens the
        sequence has to compute; in the policy's order inside each tenant. Slots come first because they are
        what preemption for fairness (`victim`) weighs: a turn given here is never one it would take back."""
        position = {seq.id: i for i, seq in enumerate(ranked)}
        levels: dict[int, dict[str | None, deque[Sequence]]] = {}
        for seq in ranked:
            levels.setdefault(seq.priority, {}).setdefault(seq.tenant, deque()).append(seq)
        out: list[Sequence] = []
        for priority in sorted(levels):
            queues = levels[priority]
            held = Counter(s.tenant for s in running if s.priority == priority)
            slots = {tenant: held.get(tenant, 0) / queues[tenant][0].share for tenant in queues}
            virtual = {tenant: self.service.get(tenant, 0.0) for tenant in queues}
            while queues and len(out) < limit:
                tenant = min(queues, key=lambda t: (slots[t], virtual[t], position[queues[t][0].id]))
                seq = queues[tenant].popleft()
                out.append(seq)
                slots[tenant] += 1 / seq.share
                virtual[tenant] += max(seq.total_len() - seq.num_computed_tokens, 1) / seq.share
                if not queues[tenant]:
                    del queues[tenant]
            if len(out) == limit:
                break
        return out

    def victim(self, running: Seq[Sequence], head: Sequence, step: int) -> Sequence | None:
        """The running sequence that gives its slot up to `head` (the next turn among the waiting ones), or None.

        Only a sequence of `head`'s priority and of another tenant is taken, of the tenant with the most running
        sequences for its share, and only when the gap is real: `head`'s tenant, with one more, would still
        hold no more for its share than that tenant with one fewer, and it has had less service for its share.
        Each such move lowers the sum over tenants of running**2 / share, so two tenants never take a slot back
        and forth. Inside the tenant: the most recently admitted of those that have run MIN_RUN_STEPS steps and
        are decoding (their prompt, recomputed or not, is done), so a sequence gains a token between preemptions.
        """
        level = [s for s in running if s.priority == head.priority]
        counts = Counter(s.tenant for s in level)
        shares = {s.tenant: s.share for s in level}
        wanted = (counts.get(head.tenant, 0) + 1) / head.share
        served = self.service.get(head.tenant, 0.0)
        for tenant in sorted(counts, key=lambda t: counts[t] / shares[t], reverse=True):
            if (counts[tenant] - 1) / shares[tenant] < wanted:
                return None                       # no gap here, nor at any tenant after it
            if tenant == head.tenant or self.service.get(tenant, 0.0) <= served:
                continue
            ready = [s for s in level if s.tenant == tenant and step - s.admitted_step >= MIN_RUN_STEPS
                     and s.total_len() - s.num_computed_tokens <= 1]
            if ready:
                return max(reversed(ready), key=lambda s: s.admitted_step)    # ties: the last admitted
        return None

    def is_under_share(self, head: Sequence, running: Seq[Sequence]) -> bool:
        """Whether `head`'s tenant is under its share beside the `running` sequences: it is more urgent than every
        one of them, or at its priority (none running more urgent) it holds fewer running sequences for its
        share than another tenant there that has had more service for its share than it."""
        if not running or head.priority < min(s.priority for s in running):
            return bool(running)
        if any(s.priority < head.priority for s in running):
            return False
        level = [s for s in running if s.priority == head.priority]
        counts = Counter(s.tenant for s in level)
        shares = {s.tenant: s.share for s in level}
        mine = counts.get(head.tenant, 0) / head.share
        served = self.service.get(head.tenant, 0.0)
        return any(tenant != head.tenant and counts[tenant] / shares[tenant] > mine
                   and self.service.get(tenant, 0.0) > served for tenant in counts)
