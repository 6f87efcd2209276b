"""The conductor's half of decode admission control: reserve room on a decode instance before
the prefill starts, so a request no decode instance can take is refused while the client has not
waited yet.

A reservation walks: POST /internal/decode/reserve on the planned decode instance -> 200 (held
until the decode job claims it, or a TTL) | 503 (its KV memory or predicted TBT does not allow
it: the scheduler picks the next decode instance, and when none is left the request gets a 429
with Retry-After) -> the decode job claims it -> or, when the request ends at prefill, a
fire-and-forget POST /internal/decode/release. An instance that does not answer the reservation
(unreachable, or without admission control) is used as planned: the decode job itself reports
what goes wrong. A request cancelled while its reservation is in flight (the client went away)
releases it too: the instance may have taken it, and an orphaned hold would count against every
later request there until its TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from mooncake_server.api.backend import GenerateRequest
from mooncake_server.roles.conductor.scheduler.policy import SLORejected
from mooncake_server.wire.instances import InstanceInfo
from mooncake_server.wire.jobs import DecodeRelease, DecodeReserve
from mooncake_server.wire.routes import (
    DECODE_RELEASE,
    DECODE_RESERVE,
    CallError,
    PeerRefused,
    call,
    send,
)

log = logging.getLogger(__name__)

Repick = Callable[[GenerateRequest, set[str]], InstanceInfo | None]
_TIMEOUT_S = 5.0
_RETRY_AFTER_S = 1.0
# Releases of reservations whose request was cancelled: the caller's task set went with it.
_orphan_releases: set[asyncio.Task[None]] = set()


async def reserve_decode(http: httpx.AsyncClient, headers: dict[str, str],
                         request: GenerateRequest, planned: InstanceInfo,
                         repick: Repick) -> InstanceInfo:
    """The decode instance now holding room for `request` (the planned one, else the next one
    `repick` offers after those that refused).

    Raises SLORejected (429, Retry-After) when every live decode instance refuses it.
    """
    body = DecodeReserve(request_id=request.request_id,
                         prompt_tokens=len(request.prompt_token_ids),
                         max_tokens=request.sampling.max_tokens)
    refused: dict[str, str] = {}
    decode: InstanceInfo | None = planned
    while decode is not None:
        try:
            await call(http, decode.url, DECODE_RESERVE, body, headers=headers,
                       timeout=_TIMEOUT_S)
            return decode  # admitted
        except PeerRefused as exc:
            if exc.status != 503:
                return decode  # an instance without admission control: the job will tell
            refused[decode.instance_id] = exc.detail
        except CallError as exc:
            log.debug("reserving on %s failed (%s); using it unreserved", decode.instance_id, exc)
            return decode
        except asyncio.CancelledError:
            release_decode_later(http, headers, decode, request.request_id, _orphan_releases)
            raise
        decode = repick(request, set(refused))
    detail = "; ".join(f"{k}: {v}" for k, v in refused.items())
    raise SLORejected(f"server overloaded: no decode instance can take the request now "
                      f"({detail}); retry in {_RETRY_AFTER_S:g} s", _RETRY_AFTER_S)


def release_decode_later(http: httpx.AsyncClient, headers: dict[str, str], decode: InstanceInfo,
                         request_id: str, tasks: set[asyncio.Task[None]]) -> None:
    """Drop a reservation in the background (the instance's TTL drops it anyway)."""

    async def release() -> None:
        try:
            await send(http, decode.url, DECODE_RELEASE, DecodeRelease(request_id=request_id),
                       headers=headers, timeout=_TIMEOUT_S)
        except CallError as exc:
            log.debug("releasing %s on %s failed: %s", request_id, decode.instance_id, exc)

    task = asyncio.get_running_loop().create_task(release())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
