"""Registration, heartbeats and draining: every instance <-> the conductor's registry.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

# Registry (every role -> conductor)


class InstanceInfo(BaseModel):
    """What an instance tells the conductor about itself when it registers."""

    instance_id: str
    role: str  # prefill | decode | store
    url: str  # HTTP base URL of its internal API
    transfer_address: str | None = None  # host:port of its transfer engine, if it serves one
    segment: str | None = None  # name of the registered memory segment others may access
    model: str | None = None
    control_address: str | None = None  # store: host:port of its binary control channel
    # New with every process start: a restarted instance is measured afresh, not judged by the
    # calibration its previous process earned.
    incarnation: str | None = None


class ConductorInfo(BaseModel):
    """What a conductor publishes about itself in etcd (--etcd): instances join each one."""

    conductor_id: str
    url: str  # HTTP base URL (registration, heartbeats, store index reports)


class PassSplit(BaseModel):
    """How a prefill instance with a cost model (--tbt-slo) computes a prompt: passes of
    `chunk_tokens`, each taking the modelled time x `ratio`; while a decode on the same cores
    (`shared`) has work, passes of `cut_tokens` taking the modelled time x `cut_ratio`, each
    after waiting about `wait_s` for the decode's step. `measured_tokens`: the largest full
    pass behind `ratio` (its speed horizon, or the start-up pass); a ratio of short passes says
    little of long ones. `cut_timed`: `cut_ratio` comes from cut passes timed here lately, not
    from full ones (a prior: passes beside a decode run at their own speed)."""

    chunk_tokens: int = Field(ge=1)
    cut_tokens: int = Field(ge=1)
    ratio: float = Field(gt=0)
    cut_ratio: float = Field(gt=0)
    wait_s: float = Field(ge=0)
    shared: bool = False
    measured_tokens: int = Field(default=0, ge=0)
    cut_timed: bool = True


class Heartbeat(BaseModel):
    """Periodic liveness and load report."""

    instance_id: str
    running: int = 0
    waiting: int = 0
    free_blocks: int | None = None
    # A decode instance with a cost model (--tbt-slo): its steps' measured / modelled time and
    # the seconds a step waits for the cores first (each the slow tail of the last seconds).
    step_ratio: float | None = None
    wait_s: float | None = None
    # ... and measured / modelled over all its recent steps: what a prefill's passes beside
    # them wait for, summed over many steps.
    step_ratio_mean: float | None = None
    # A prefill instance with a cost model: how its passes go now (TTFT estimates).
    passes: PassSplit | None = None


class StoreLocation(BaseModel):
    """Where a store node's control API and data segment live."""

    instance_id: str
    url: str
    transfer_address: str
    segment: str
    control_address: str | None = None  # binary control channel; None = HTTP at `url` only

    @classmethod
    def of(cls, info: InstanceInfo) -> StoreLocation | None:
        """The location a registered store instance advertised (None if it serves no segment)."""
        if not info.transfer_address or not info.segment:
            return None
        return cls(instance_id=info.instance_id, url=info.url,
                   transfer_address=info.transfer_address, segment=info.segment,
                   control_address=info.control_address)


# ---------------------------------------------------------------------------------------------
# Registry replies (conductor -> instances and operators). Owned by the conductor's registry.


class InstanceStatus(BaseModel):
    """One registered instance as the conductor sees it (GET /internal/instances)."""

    info: InstanceInfo
    alive: bool
    seconds_since_heartbeat: float
    load: Heartbeat | None = None
    draining: bool = False  # finishing its work after SIGTERM: never picked for new work


class Deregister(BaseModel):
    """An instance leaving on purpose (graceful shutdown): stop routing to it now."""

    instance_id: str


class Drain(BaseModel):
    """An instance got SIGTERM: send it no new work; it finishes what it runs, then leaves."""

    instance_id: str
