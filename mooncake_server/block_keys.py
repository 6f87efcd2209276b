"""Chained block keys: the identity of a prompt prefix's KV blocks in the store and indexes.

`key_i = H(key_{i-1} || tokens of block i)`, with `key_{-1} = H(namespace)`. A key therefore names
a whole prefix, not one block's tokens: two prompts share key i exactly when they share their first
`(i + 1) * block_tokens` tokens (and model, dtype and block size, which the namespace encodes).
"""

from __future__ import annotations

import asyncio
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

# NOTE: bumping this invalidates every stored block (layout or hashing changed).
KEY_SCHEME_VERSION = 2  # 2: heads outside tokens in a block (kv_cache.py)
_DIGEST_SIZE = 16
# Whichever array typecode is 4 bytes on this platform ('i' everywhere we run).
_INT32 = next(code for code in "ilh" if array(code).itemsize == 4)


def kv_namespace(model_name: str, dtype: str, block_tokens: int) -> str:
    """Namespace string that keeps keys of different models / KV layouts apart."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    return f"mooncake-kv/v{KEY_SCHEME_VERSION}/{model_name}/{dtype}/bt{block_tokens}"


def block_keys(token_ids: Sequence[int], block_tokens: int, namespace: str,
               after: str | None = None) -> list[str]:
    """One hex key per FULL block of `token_ids`; a trailing partial block gets none.

    `after` is the key of the block just before `token_ids[0]` (None: they start the sequence),
    so a chain can be extended block by block without hashing its beginning again.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    n_blocks = len(token_ids) // block_tokens
    if n_blocks == 0:
        return []
    try:
        packed = array(_INT32, token_ids[: n_blocks * block_tokens])
    except OverflowError as exc:
        raise ValueError("token ids must fit in a signed 32-bit integer") from exc
    if sys.byteorder != "little":
        packed.byteswap()
    data = memoryview(packed.tobytes())
    step = block_tokens * 4
    prev = (bytes.fromhex(after) if after is not None
            else blake2b(namespace.encode(), digest_size=_DIGEST_SIZE).digest())
    keys: list[str] = []
    for start in range(0, n_blocks * step, step):
        h = blake2b(prev, digest_size=_DIGEST_SIZE)
        h.update(data[start : start + step])
        prev = h.digest()
        keys.append(prev.hex())
    return keys


# Hashing this many tokens takes ~10 ms: above it, a server hashes off its event loop.
_OFF_LOOP_ABOVE = 100_000


async def block_keys_async(token_ids: Sequence[int], block_tokens: int, namespace: str,
                           after: str | None = None) -> list[str]:
    """`block_keys`, in a worker thread when there are enough tokens to stall an event loop."""
    if len(token_ids) > _OFF_LOOP_ABOVE:
        return await asyncio.to_thread(block_keys, token_ids, block_tokens, namespace, after)
    return block_keys(token_ids, block_tokens, namespace, after)
