"""One request's state while the conductor serves it: its plan, its prefill result, its output."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mooncake_server.api.backend import GenerateRequest
from mooncake_server.roles.conductor.scheduler.policy import Plan
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.jobs import PrefillFirst, PrefillResult, SamplingParams

PREFILL = "prefill"
DECODE = "decode"


@dataclass
class RequestFlow:
    """A request from its plan to its last token (read and changed by the path and its moves)."""

    request: GenerateRequest
    keys: list[str]  # chained keys of the prompt's full blocks, hashed once
    plan: Plan  # where it runs now; a move replaces the plan's prefill or decode instance
    phase: str = PREFILL
    result: PrefillResult | None = None
    # The first tokens, from the first prefill instance that computed the prompt (before its
    # store writes); a re-sent prefill's own first tokens give way to these, the client has them.
    first: PrefillFirst | None = None
    first_ready: asyncio.Event = field(default_factory=asyncio.Event)
    tail_settled: bool = False  # the decode instance took the tail block, or it was removed
    reserved_on: InstanceInfo | None = None  # decode instance holding room until its job starts
    delivered: list[int] = field(default_factory=list)  # output after the first token, passed on
    moves: int = 0
    move: asyncio.Event = field(default_factory=asyncio.Event)  # an operator ordered a move
    move_target: str | None = None
    refused: set[str] = field(default_factory=set)  # decode instances that refused it
    choice: int = 0  # which of the request's n choices this flow decodes
    # Keys of every full block of the tokens computed so far: the prompt's, extended on a move.
    chain: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.chain = list(self.keys)

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def sampling(self) -> SamplingParams:
        """The sampling of this flow's choice (its own seed when n > 1)."""
        return self.request.sampling.for_choice(self.choice)

    def got_first(self, first: PrefillFirst) -> None:
        """A prefill instance computed the prompt: keep its first tokens, unless some came before."""
        if self.first is None:
            self.first = first
            self.first_ready.set()

    def serving(self) -> InstanceInfo:
        """The instance working on the request now."""
        return self.plan.decode if self.phase == DECODE else self.plan.prefill
