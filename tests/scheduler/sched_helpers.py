"""Synthetic clusters for the scheduler tests: a registry of instances and a hand-moved clock."""

from __future__ import annotations

from mooncake_server.api.backend import GenerateRequest
from mooncake_server.cost_model.perf_model import PerfModel
from mooncake_server.roles.conductor.registry import InstanceRegistry
from mooncake_server.wire.instances import Heartbeat, InstanceInfo
from mooncake_server.wire.jobs import SamplingParams

BT = 16
# Round numbers: 1 ms per token + 10 ms per pass; a decode step 20 ms + 5 ms per sequence.
MODEL = PerfModel(prefill_a=0.0, prefill_b=1e-3, prefill_c=0.01, prefill_e=0.0,
                  decode_d0=0.02, decode_d1=0.005, decode_d2=0.0, kv_bytes_per_token=1000,
                  transfer_bytes_per_s=1e8, block_tokens=BT)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cluster(prefill: int = 2, decode: int = 2, store: int = 1,
            clock: Clock | None = None) -> InstanceRegistry:
    """A registry with p1.., d1.., s1.. alive (each on its own host)."""
    reg = InstanceRegistry(heartbeat_timeout_s=1e6, clock=clock or Clock())
    for role, prefix, count in (("prefill", "p", prefill), ("decode", "d", decode),
                                ("store", "s", store)):
        for i in range(1, count + 1):
            iid = f"{prefix}{i}"
            reg.register(InstanceInfo(instance_id=iid, role=role, url=f"http://{iid}:1",
                                      transfer_address=f"{iid}:2", segment="seg"))
            reg.heartbeat(Heartbeat(instance_id=iid))
    return reg


def request(rid: str, prompt_tokens: int, max_tokens: int = 8) -> GenerateRequest:
    """A request with a prompt of `prompt_tokens` tokens."""
    return GenerateRequest(rid, list(range(prompt_tokens)),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0))
