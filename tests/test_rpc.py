"""The binary RPC channel: calls, errors, authentication, broken peers, fire-and-forget."""

from __future__ import annotations

import asyncio
import struct

import pytest

from mooncake_server.wire.rpc import (
    MAGIC,
    MAX_FRAME,
    RpcClient,
    RpcError,
    RpcServer,
    RpcStatus,
    RpcUnavailable,
)

SECRET = b"rpc-test-secret"
ECHO, UPPER_LATER, BAD, UNAVAILABLE, BOOM, RECORD = 1, 2, 3, 4, 5, 6


def handlers(log: list[bytes]) -> dict[int, object]:
    """Sync and async handlers, and each kind of failure."""
    async def upper_later(payload: bytes) -> bytes:
        await asyncio.sleep(0.01)  # answers after calls sent behind it
        return payload.upper()

    def bad(payload: bytes) -> bytes:
        raise ValueError(f"cannot use {payload!r}")

    def unavailable(_: bytes) -> bytes:
        raise RpcUnavailable("starting")

    def boom(_: bytes) -> bytes:
        raise KeyError("bug")

    def record(payload: bytes) -> bytes:
        log.append(payload)
        return b"ok"

    return {ECHO: lambda p: p, UPPER_LATER: upper_later, BAD: bad, UNAVAILABLE: unavailable,
            BOOM: boom, RECORD: record}


@pytest.fixture
async def served():
    log: list[bytes] = []
    server = RpcServer(handlers(log), SECRET)  # type: ignore[arg-type]
    port = await server.start("127.0.0.1")
    yield server, f"127.0.0.1:{port}", log
    await server.close()


async def test_calls_are_pipelined_and_each_gets_its_own_reply(served):
    _, address, _ = served
    client = RpcClient(address, SECRET, timeout_s=5)
    slow = asyncio.create_task(client.call(UPPER_LATER, b"slow"))
    replies = await asyncio.gather(*(client.call(ECHO, f"k{i}".encode() * i) for i in range(200)))
    assert replies == [f"k{i}".encode() * i for i in range(200)]
    assert await slow == b"SLOW"
    assert await client.call(ECHO, b"") == b""
    await client.aclose()


async def test_handler_errors_come_back_with_their_status_and_the_connection_lives_on(served):
    _, address, _ = served
    client = RpcClient(address, SECRET, timeout_s=5)
    for op, status, text in ((BAD, RpcStatus.BAD_REQUEST, "cannot use"),
                             (UNAVAILABLE, RpcStatus.UNAVAILABLE, "starting"),
                             (BOOM, RpcStatus.INTERNAL, "KeyError"),
                             (99, RpcStatus.UNKNOWN_OP, "unknown op 99")):
        with pytest.raises(RpcError, match=text) as info:
            await client.call(op, b"x")
        assert info.value.status == status
    assert await client.call(ECHO, b"still here") == b"still here"
    await client.aclose()


async def test_a_client_without_the_secret_is_refused_and_others_are_unaffected(served):
    _, address, log = served
    intruder = RpcClient(address, b"wrong", timeout_s=5)
    with pytest.raises(RpcError, match="refused our credentials"):
        await intruder.call(RECORD, b"intruder")
    assert log == []
    assert await RpcClient(address, SECRET, timeout_s=5).call(ECHO, b"hi") == b"hi"


async def test_a_server_without_the_secret_is_not_trusted():
    """An impostor that accepts any client but cannot prove the secret gets no call."""
    after_proof: list[bytes] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(MAGIC + b"n" * 16)
        await reader.readexactly(16 + 32)  # the client's nonce and proof, taken on trust
        writer.write(b"\x00" * 32)  # a proof made without the secret
        after_proof.append(await reader.read())  # whatever the client sends next, until EOF
        writer.close()

    fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = fake.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RpcError, match="failed to prove it holds the cluster secret"):
            await RpcClient(f"127.0.0.1:{port}", SECRET, timeout_s=5).call(ECHO, b"secret data")
        async with asyncio.timeout(5):
            while not after_proof:
                await asyncio.sleep(0.01)
        assert after_proof == [b""]  # the call was never sent
    finally:
        fake.close()
        await fake.wait_closed()


async def test_garbage_and_oversized_frames_drop_only_that_connection(served):
    _, address, _ = served
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readexactly(6 + 16)  # magic + nonce
    writer.write(b"\x00" * 48)  # a wrong proof
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without an answer
    writer.close()
    # An authenticated peer announcing a frame over the limit is dropped too.
    client = RpcClient(address, SECRET, timeout_s=5)
    await client.call(ECHO, b"warm")
    conn = client._conn
    assert conn is not None
    conn.write(struct.pack("<IIBB2x", MAX_FRAME + 1, 7, ECHO, 0))
    with pytest.raises(RpcError):
        await client.call(ECHO, b"behind the bad frame")
    assert await client.call(ECHO, b"redialled") == b"redialled"
    await client.aclose()


async def test_notifications_run_in_order_before_later_calls_answer(served):
    _, address, log = served
    client = RpcClient(address, SECRET, timeout_s=5)
    assert not client.notify(RECORD, b"before connecting")  # nothing open to send it on
    await client.call(ECHO, b"connect")
    for i in range(50):
        assert client.notify(RECORD, str(i).encode())
    assert await client.call(RECORD, b"fence") == b"ok"
    assert log == [str(i).encode() for i in range(50)] + [b"fence"]
    await client.aclose()


async def test_a_dying_server_fails_waiting_calls_at_once_and_a_restarted_one_is_redialled():
    server = RpcServer(handlers([]), SECRET)  # type: ignore[arg-type]
    port = await server.start("127.0.0.1")
    client = RpcClient(f"127.0.0.1:{port}", SECRET, timeout_s=30)
    assert await client.call(ECHO, b"a") == b"a"
    pending = asyncio.create_task(client.call(UPPER_LATER, b"never"))
    await asyncio.sleep(0)  # the call is on the wire
    await server.close()
    with pytest.raises(RpcError, match="lost|closed"):
        await asyncio.wait_for(pending, 5)  # well before the 30 s call timeout
    with pytest.raises(RpcError, match="unreachable"):
        await client.call(ECHO, b"nobody there")
    server = RpcServer(handlers([]), SECRET)  # type: ignore[arg-type]
    await server.start("127.0.0.1", port)
    try:
        assert await client.call(ECHO, b"back") == b"back"
    finally:
        await client.aclose()
        await server.close()


async def test_a_peer_that_never_answers_times_out():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, never speaks

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = mute.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RpcError, match="no handshake within 0.3 s"):
            await RpcClient(f"127.0.0.1:{port}", SECRET, timeout_s=0.3).call(ECHO, b"x")
    finally:
        mute.close()
        await mute.wait_closed()
