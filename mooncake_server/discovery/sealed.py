"""Values in etcd sealed with the cluster secret, so etcd access alone admits no one.

A sealed value is `hex(HMAC-SHA256(secret, key NUL payload)) "." payload`: binding the key keeps a
value from being replayed under another key (an instance's info as a conductor's, say). Anyone
able to write etcd but without the secret can delete keys (deny service), never add a member the
conductors would send work, or the secret in a header, to.
"""

from __future__ import annotations

import hashlib
import hmac


def _mac(secret: str, key: str, payload: bytes) -> bytes:
    return hmac.new(secret.encode(), key.encode() + b"\0" + payload, hashlib.sha256
                    ).hexdigest().encode()


def seal(secret: str, key: str, payload: bytes) -> bytes:
    """`payload` as stored under `key`."""
    return _mac(secret, key, payload) + b"." + payload


def unseal(secret: str, key: str, value: bytes) -> bytes | None:
    """The payload of a value sealed for `key` with `secret`; None if it was not."""
    mac, dot, payload = value.partition(b".")
    if not dot or not hmac.compare_digest(mac, _mac(secret, key, payload)):
        return None
    return payload
