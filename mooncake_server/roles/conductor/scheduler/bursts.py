"""What the scheduler keeps about the burst it is deciding, and how a decided burst is settled.

A prefill instance batches a burst's jobs, in rank order, into one full pass as long as their
prompts fit its chunk (--prefill-chunk); the first job that does not fit, and every one after it,
runs after that pass, while the pass's requests decode beside it, so in short cut passes that
each wait for a decode step. In a replay a 1,518-token prompt estimated as if it ran at full
speed took 11.6 s behind a burst's first pass (est. under 5 s). So the burst is tracked per
prefill instance: the prompt tokens its first pass holds so far, and whether that pass is full.

Once the burst is decided (`settle`): the ranks are renumbered per prefill instance (the
instance waits for the ranks before its head, and ranks sent elsewhere never come), each job
says how many ranks share its first pass (the instance waits for all of them before starting
it: a pass started with the first arrivals left the rest to later passes, 2 s apart), and
every request of a first pass is predicted to answer when the pass ends, which it does, and must
start by the pass's deadline, not its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake_server.api.burst import Order

if TYPE_CHECKING:
    from mooncake_server.roles.conductor.scheduler.policy import Plan


@dataclass
class BurstState:
    """The burst being decided: what was placed where."""

    at: float | None = None
    placed: dict[str, int] = field(default_factory=dict)  # instance -> requests placed on it
    first_pass: dict[str, int] = field(default_factory=dict)  # prefill -> its first pass's tokens
    full: set[str] = field(default_factory=set)  # prefills whose first pass takes no more

    def count(self, instance_id: str) -> int:
        """Requests of this burst placed on the instance so far."""
        return self.placed.get(instance_id, 0)

    def fits_first_pass(self, instance_id: str, prompt_tokens: int, chunk_tokens: int) -> bool:
        """Whether a prompt placed now joins the burst's first full pass on the instance."""
        if instance_id in self.full:
            return False
        held = self.first_pass.get(instance_id, 0)
        return not held or held + prompt_tokens <= chunk_tokens

    def record(self, prefill_id: str, decode_id: str, prompt_tokens: int,
               first_pass: bool) -> None:
        """A request of the burst was placed (its prefill in the first pass or after it)."""
        for iid in (prefill_id, decode_id):
            self.placed[iid] = self.placed.get(iid, 0) + 1
        if first_pass:
            self.first_pass[prefill_id] = self.first_pass.get(prefill_id, 0) + prompt_tokens
        else:
            self.full.add(prefill_id)


def settle(plans: list[Plan | None]) -> list[Plan | None]:
    """The burst's plans with ranks per prefill instance, their first passes' sizes, and each
    first-pass member's TTFT estimate and start deadline those of the whole pass."""
    by_instance: dict[str, list[int]] = {}
    for i, plan in enumerate(plans):
        if plan is not None and plan.order is not None:
            by_instance.setdefault(plan.prefill.instance_id, []).append(i)
    out = list(plans)
    for members in by_instance.values():
        firsts = [i for i in members if _plan(out, i).first_pass]
        pass_ranks = len(firsts) if len(firsts) > 1 else 0
        end = max((_plan(out, i).prefill_estimate.ttft_s for i in firsts), default=0.0)
        start = min((_plan(out, i).prefill_estimate.queue_s for i in firsts), default=0.0)
        for rank, i in enumerate(members):
            plan = _plan(out, i)
            assert plan.order is not None
            order = Order(plan.order.burst_at, rank,
                          pass_ranks if rank < pass_ranks else 0)
            if plan.first_pass and pass_ranks:
                est = plan.prefill_estimate._replace(ttft_s=end)
                start_by = plan.start_by
                if start_by is not None:
                    # The pass starts once, for all of them: early enough for the whole pass.
                    own = plan.prefill_estimate.ttft_s - plan.prefill_estimate.queue_s
                    start_by += own - (end - start)
                out[i] = plan._replace(order=order, prefill_estimate=est, start_by=start_by)
            else:
                out[i] = plan._replace(order=order)
    return out


def _plan(plans: list[Plan | None], i: int) -> Plan:
    plan = plans[i]
    assert plan is not None
    return plan
