"""The conductor's ledger of work in flight on each instance, merged with their heartbeats.

A request, as the ledger sees it: assigned (queued on its prefill instance with a time estimate,
counted in its decode instance's batch) -> first token (leaves the prefill queue; the measured
prefill time calibrates that instance's later estimates) -> tokens (its decode context grows;
the gaps between them calibrate the decode instance's step-time estimates) ->
finished (leaves the decode batch). Heartbeats arrive about once a second; the ledger changes
with every request, so between beats it is the fresher view, and a beat reporting more work than
the ledger knows (another conductor, a restart) raises the estimate, never lowers it. A beat
still counts the work that left since it was sent, so what the ledger saw leave after the beat
is taken off the beat's count: read whole, an idle cluster's last beat (sent while a request
decoded, up to a second old) made the next lone prompt's estimate that of cut passes beside a
busy decode, and a 512-token prompt was refused at 5.00 s on an idle `--role all`.
Calibrations keep only the measurements of the last `horizon_s` seconds (calibration.py): an
instance that gets no work, say because its slow measurements made the SLOs reject everything,
is judged by the model again once they age out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from mooncake_server.cost_model.calibration import (
    DEFAULT_HORIZON_S,
    SmoothedCalibration,
    TailMeanCalibration,
    TailSeconds,
)
from mooncake_server.wire.instances import Heartbeat

# First tokens closer together than this came out of one batched prefill pass: the prefill
# instance answers a pass's jobs back to back, and a pass takes longer than this.
SAME_PASS_S = 0.05

# The hand-off gap is at least this many decode steps (wait for the running step, then the
# request's own); what it measured recently (KV load, waits for the cores) when longer.
HANDOFF_STEPS = 2.0
# The share of hand-off gaps a request's TBT estimate budgets for: the share of accepted requests
# meant to meet their SLOs.
HANDOFF_QUANTILE = 0.95


@dataclass
class _PrefillEntry:
    request_id: str
    estimate_s: float  # uncalibrated model estimate
    assigned_at: float
    # estimate_s came from the instance's own account of its passes (PassSplit): it is not
    # calibrated again, and it does not calibrate the model-only estimates either.
    own_split: bool = False


@dataclass
class _Pass:
    """Prefills answered together: one batched forward, timed against their summed estimates."""

    started: float
    estimate_s: float
    ended: float


class _Calibrations(NamedTuple):
    """What one process of an instance measured against the model."""

    # Measured / estimated prefill time of a queue's head, smoothed; clamped (0.25..8) so one
    # outlier cannot make an instance look idle or dead.
    prefill: SmoothedCalibration
    # Every token gap against the modelled step: the slow tail, as TBT is judged (CPU
    # contention on a shared host can slow steps many times over).
    decode: TailMeanCalibration
    # The gap between a request's first token (prefill) and its second (decode's first step):
    # the hand-off (decode job, KV load, joining the batch), in seconds. With short outputs it
    # is the longest gap, so it decides the request's TBT; one per request, so the quantile kept
    # is the share of requests meant to meet the SLO. It is mostly waiting (for the running
    # step, a prefill pass on the cores), which a batch's size hardly changes: as a ratio to
    # modelled steps it scaled a small batch's slow hand-offs up to a large one's. In a trace
    # replay of `--role all` (hand-offs p50 80 ms, p95 180-195 ms, p98 210-250 ms), the ratio's
    # 98th percentile turned away short answers that 19 in 20 times met a 200 ms SLO.
    handoff: TailSeconds


@dataclass
class _Instance:
    cal: _Calibrations
    prefill: list[_PrefillEntry] = field(default_factory=list)  # FIFO, as the instance serves
    last_done_at: float = float("-inf")
    open_pass: _Pass | None = None  # the last first tokens, until the pass is surely over
    decode: dict[str, int] = field(default_factory=dict)  # request id -> context tokens
    left_since_beat: int = 0  # requests of this ledger that left it after its last heartbeat


class DecodeLoad(NamedTuple):
    """A decode instance's batch: sequences and the context tokens they attend in all."""

    batch: int
    context_tokens: int


class LoadTracker:
    """Per-instance prefill queues and decode batches of requests this conductor placed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *,
                 horizon_s: float = DEFAULT_HORIZON_S) -> None:
        self._clock = clock
        self.horizon_s = horizon_s
        self._instances: dict[str, _Instance] = {}
        self._prefill_of: dict[str, str] = {}  # request id -> prefill instance
        self._decode_of: dict[str, str] = {}  # request id -> decode instance
        self._last_token_at: dict[str, float] = {}  # request id -> its previous token's arrival
        self._first_token_at: dict[str, float] = {}  # request id -> prefill's token, until decode's
        self._incarnations: dict[str, str] = {}  # instance id -> the process last registered
        # request id -> (its context once every choice streamed max_tokens, choices): what it
        # has left is read off its context, which grows by one with each token
        self._ends: dict[str, tuple[int, int]] = {}

    def now(self) -> float:
        """The ledger's clock (monotonic seconds; scripted in tests)."""
        return self._clock()

    def _get(self, instance_id: str) -> _Instance:
        inst = self._instances.get(instance_id)
        if inst is None:
            inst = self._instances[instance_id] = _Instance(self._fresh_calibrations())
        return inst

    def _fresh_calibrations(self) -> _Calibrations:
        h, clock = self.horizon_s, self._clock
        return _Calibrations(SmoothedCalibration(horizon_s=h, clock=clock),
                             TailMeanCalibration(horizon_s=h, clock=clock),
                             TailSeconds(quantile=HANDOFF_QUANTILE, horizon_s=h, clock=clock))

    # ---- events -------------------------------------------------------------------------------

    def registered(self, instance_id: str, incarnation: str | None) -> None:
        """An instance (re-)registered; a new process under the same id starts uncalibrated."""
        if incarnation is None:
            return
        previous = self._incarnations.get(instance_id)
        self._incarnations[instance_id] = incarnation
        inst = self._instances.get(instance_id)
        if previous is None or previous == incarnation or inst is None:
            return
        # Its work in flight stays counted (failover moves it and tells us); what it measured
        # about the dead process (often a cold start's slow outliers) must not starve the new one.
        inst.cal = self._fresh_calibrations()
        inst.last_done_at = float("-inf")

    def assign(self, request_id: str, prefill_id: str, prefill_estimate_s: float,
               decode_id: str, context_tokens: int, *, own_split: bool = False,
               max_tokens: int | None = None, choices: int = 1) -> None:
        """A request was placed: queue its prefill, count it in its decode batch (and, with
        `max_tokens`, how long it may decode: the prefill makes each choice's first token)."""
        if max_tokens is not None:
            self._ends[request_id] = (context_tokens + max(0, max_tokens - 1) * choices,
                                      max(1, choices))
        self._get(prefill_id).prefill.append(
            _PrefillEntry(request_id, prefill_estimate_s, self._clock(), own_split))
        self._prefill_of[request_id] = prefill_id
        self._get(decode_id).decode[request_id] = context_tokens
        self._decode_of[request_id] = decode_id

    def handed_on(self, request_id: str) -> None:
        """The request's hand-off to its decode starts now, not at its first token: the
        prefill held it (prefill/hand_on.py), which the decode's hand-off time must not learn."""
        if request_id in self._first_token_at:
            self._first_token_at[request_id] = self._clock()

    def prefill_done(self, request_id: str) -> None:
        """The request's first token arrived: its prefill left the queue."""
        prefill_id = self._prefill_of.pop(request_id, None)
        if prefill_id is None:
            return
        inst = self._get(prefill_id)
        inst.left_since_beat += 1
        now = self._clock()
        self._first_token_at[request_id] = now
        for i, entry in enumerate(inst.prefill):
            if entry.request_id == request_id:
                p = inst.open_pass
                if entry.own_split:
                    self._close_pass(inst)
                elif p is not None and now - p.ended <= SAME_PASS_S:
                    p.estimate_s += entry.estimate_s
                    p.ended = now
                else:
                    self._close_pass(inst)
                    if i == 0:
                        # Only a pass that began with the head was timed from its start; the
                        # jobs answered with it share that time (the worker batches a queue).
                        inst.open_pass = _Pass(max(entry.assigned_at, inst.last_done_at),
                                               entry.estimate_s, now)
                del inst.prefill[i]
                break
        inst.last_done_at = now

    @staticmethod
    def _close_pass(inst: _Instance) -> None:
        """Calibrate by the open pass, if any: its time against its jobs' summed estimates."""
        p, inst.open_pass = inst.open_pass, None
        if p is not None:
            inst.cal.prefill.add(p.ended - p.started, p.estimate_s, at=p.ended)

    def _settle(self, inst: _Instance) -> None:
        """Close the open pass once no more first tokens can belong to it."""
        if inst.open_pass is not None and self._clock() - inst.open_pass.ended > SAME_PASS_S:
            self._close_pass(inst)

    def token(self, request_id: str, predicted_step_s: float | None = None) -> None:
        """One more token decoded: the request's context grows by one.

        With `predicted_step_s` (the model's step time for the batch now), the gap since the
        request's previous token calibrates its decode instance; the gap after the first token
        includes loading the KV, so it is not used.
        """
        decode_id = self._decode_of.get(request_id)
        if decode_id is None:
            return
        inst = self._get(decode_id)
        if request_id in inst.decode:
            inst.decode[request_id] += 1
        now = self._clock()
        last = self._last_token_at.get(request_id)
        self._last_token_at[request_id] = now
        first = self._first_token_at.pop(request_id, None)
        if not predicted_step_s:
            return
        if last is not None:
            inst.cal.decode.add(now - last, predicted_step_s)
        elif first is not None:
            inst.cal.handoff.add_seconds(now - first)

    def move_decode(self, request_id: str, decode_id: str) -> None:
        """The request's decode instance changed (the planned one refused it at admission)."""
        old = self._decode_of.get(request_id)
        if old is None or old == decode_id:
            return
        left = self._get(old)
        context = left.decode.pop(request_id, 0)
        left.left_since_beat += 1
        self._get(decode_id).decode[request_id] = context
        self._decode_of[request_id] = decode_id
        # The next gap includes the move (loading KV): it must not calibrate either instance.
        self._last_token_at.pop(request_id, None)
        self._first_token_at.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        """The request ended (any outcome): forget it everywhere."""
        if request_id in self._prefill_of:
            prefill_id = self._prefill_of.pop(request_id)
            inst = self._get(prefill_id)
            inst.prefill = [e for e in inst.prefill if e.request_id != request_id]
            inst.left_since_beat += 1
        decode_id = self._decode_of.pop(request_id, None)
        if decode_id is not None:
            inst = self._get(decode_id)
            if inst.decode.pop(request_id, None) is not None:
                inst.left_since_beat += 1
        self._last_token_at.pop(request_id, None)
        self._first_token_at.pop(request_id, None)
        self._ends.pop(request_id, None)

    def heard(self, instance_id: str) -> None:
        """A heartbeat of the instance arrived: it counts the work that left before it."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.left_since_beat = 0

    # ---- views --------------------------------------------------------------------------------

    def calibration(self, instance_id: str) -> float:
        """Measured / estimated prefill time on this instance (1.0 until measured)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return 1.0
        self._settle(inst)
        return inst.cal.prefill.value

    def handoff_s(self, instance_id: str) -> float:
        """Seconds of a decode instance's recent hand-off gaps, their slow tail (0.0: none)."""
        inst = self._instances.get(instance_id)
        return inst.cal.handoff.value if inst else 0.0

    def decode_calibration(self, instance_id: str) -> float:
        """Measured / modelled decode step time on this instance (1.0 until measured)."""
        inst = self._instances.get(instance_id)
        return inst.cal.decode.value if inst else 1.0

    def decode_of(self, request_id: str) -> str | None:
        """The decode instance a request was placed on."""
        return self._decode_of.get(request_id)

    def prefill_queue_s(self, instance_id: str, beat: Heartbeat | None = None) -> float:
        """Seconds until this instance could start a new prefill (calibrated)."""
        inst = self._instances.get(instance_id)
        cal = self.calibration(instance_id)
        queue = [e.estimate_s * (1.0 if e.own_split else cal) for e in inst.prefill] \
            if inst else []
        total = sum(queue)
        if inst and inst.prefill:
            head = inst.prefill[0]
            running_for = self._clock() - max(head.assigned_at, inst.last_done_at)
            total -= min(max(0.0, running_for), queue[0])
        waiting = self._beat_work(instance_id, beat.waiting) if beat is not None else 0
        if waiting > len(queue):
            # Work we did not place: assume it costs what ours costs on average (or 0 if unknown).
            mean = sum(queue) / len(queue) if queue else 0.0
            total += (waiting - len(queue)) * mean
        return max(0.0, total)

    def prefill_queue_len(self, instance_id: str, beat: Heartbeat | None = None) -> int:
        """Prefill jobs queued or running on this instance."""
        inst = self._instances.get(instance_id)
        ours = len(inst.prefill) if inst else 0
        return max(ours, self._beat_work(instance_id, beat.waiting) if beat else 0)

    def decode_load(self, instance_id: str, beat: Heartbeat | None = None) -> DecodeLoad:
        """Sequences on this decode instance and their total context."""
        inst = self._instances.get(instance_id)
        batch = len(inst.decode) if inst else 0
        context = sum(inst.decode.values()) if inst else 0
        reported = self._beat_work(instance_id, beat.running + beat.waiting) if beat else 0
        if reported > batch:
            mean = context / batch if batch else 0
            context += int((reported - batch) * mean)
            batch = reported
        return DecodeLoad(batch, context)

    def decode_steps_left(self, instance_id: str, excluding: Collection[str] = ()) -> int | None:
        """The most steps any request on this decode instance (but `excluding`) may still take
        (0: none decodes); None when one's length is unknown."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return 0
        most = 0
        for rid, context in inst.decode.items():
            if rid in excluding:
                continue
            end = self._ends.get(rid)
            if end is None:
                return None
            most = max(most, -(-max(0, end[0] - context) // end[1]))
        return most

    def _beat_work(self, instance_id: str, reported: int) -> int:
        """A heartbeat's count of work, less what this ledger saw leave since it was sent."""
        inst = self._instances.get(instance_id)
        return max(0, reported - (inst.left_since_beat if inst else 0))

    def in_flight(self) -> int:
        """Requests placed and not finished."""
        return len(self._decode_of)
