"""CRC32C: the known vector, buffer vs address forms, hardware vs table implementation."""

from __future__ import annotations

import ctypes
import os

import pytest

from mooncake_server.transfer import _native, crc32c


def test_known_vector() -> None:
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


def test_address_form_matches_buffer_form() -> None:
    data = bytearray(os.urandom(100_003))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(data))
    assert crc32c(addr, len(data)) == crc32c(data) == crc32c(memoryview(data))
    assert crc32c(addr + 7, 1000) == crc32c(bytes(data[7:1007]))


@pytest.mark.parametrize("size", [1, 7, 8, 63, 4096, 1_000_001])
def test_hardware_and_software_agree(size: int) -> None:
    data = os.urandom(size)
    assert crc32c(data) == _native.crc32c_software(data)


def test_address_without_length_is_rejected() -> None:
    with pytest.raises(TypeError):
        crc32c(12345)
