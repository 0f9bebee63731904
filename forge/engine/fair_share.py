"""Priorities and fair turns between tenants: the order in which waiting sequences are offered for admission.

A sequence carries a priority (lower is more urgent, vLLM's meaning) and a tenant (None is a tenant too,
the one of every request that names none) with its share. Waiting sequences are admitted by priority
first; within a priority, the tenant that has received the least service for its share goes next, so a
tenant with 64 queued sequences does not starve one with 1. Service is the tokens scheduled for a tenant's
sequences, divided by its share and decayed every step (a half-life of HALF_LIFE_STEPS), so it measures
recent use, not all-time use. Inside one tenant the scheduling policy's order stands (forge.engine.schedule_policy).

Pure bookkeeping for the scheduler (forge.engine.scheduler), which owns the sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq

from forge.engine.sequence import Sequence

HALF_LIFE_STEPS = 64
_DECAY = 0.5 ** (1 / HALF_LIFE_STEPS)
_FORGET_BELOW = 1e-3              # service this small is forgotten (the table holds recent tenants only)


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

    def order(self, ranked: list[Sequence], limit: int) -> list[Sequence]:
        """Up to `limit` of `ranked` (the policy's order): by priority, then turn by turn to the tenant with
        the least service for its share, each turn counted as the tokens the sequence has to compute, in
        the policy's order inside each tenant."""
        position = {seq.id: i for i, seq in enumerate(ranked)}
        levels: dict[int, dict[str | None, deque[Sequence]]] = {}
        for seq in ranked:
            levels.setdefault(seq.priority, {}).setdefault(seq.tenant, deque()).append(seq)
        out: list[Sequence] = []
        for priority in sorted(levels):
            queues = levels[priority]
            virtual = {tenant: self.service.get(tenant, 0.0) for tenant in queues}
            while queues and len(out) < limit:
                tenant = min(queues, key=lambda t: (virtual[t], position[queues[t][0].id]))
                seq = queues[tenant].popleft()
                out.append(seq)
                virtual[tenant] += max(seq.total_len() - seq.num_computed_tokens, 1) / seq.share
                if not queues[tenant]:
                    del queues[tenant]
            if len(out) == limit:
                break
        return out
