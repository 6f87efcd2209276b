"""Chained block keys: prefix sharing, chaining, namespacing, speed."""

from __future__ import annotations

import random
import time

import pytest

from mooncake_server.block_keys import block_keys, kv_namespace

NS = kv_namespace("SmolLM2-135M-Instruct", "float32", 4)


def test_one_key_per_full_block() -> None:
    assert block_keys(list(range(11)), 4, NS) == block_keys(list(range(8)), 4, NS)
    assert len(block_keys(list(range(11)), 4, NS)) == 2
    assert block_keys([1, 2, 3], 4, NS) == []
    keys = block_keys(list(range(8)), 4, NS)
    assert all(len(k) == 32 and int(k, 16) >= 0 for k in keys)  # 16-byte blake2b, hex


def test_prefix_sharing_prompts_share_leading_keys() -> None:
    shared = list(range(1000, 1012))  # 3 blocks
    a = block_keys(shared + [1, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    b = block_keys(shared + [9, 9, 9, 9], 4, NS)
    assert a[:3] == b[:3]
    assert a[3] != b[3]


def test_a_changed_token_changes_its_key_and_all_after() -> None:
    tokens = list(range(20))
    changed = tokens.copy()
    changed[9] = 999  # inside block 2 (tokens 8..11)
    a, b = block_keys(tokens, 4, NS), block_keys(changed, 4, NS)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_keys_are_chained_not_per_block() -> None:
    # Same block content at a different position -> a different key.
    keys = block_keys([7, 7, 7, 7, 7, 7, 7, 7], 4, NS)
    assert keys[0] != keys[1]


def test_namespace_separates_models_and_layouts() -> None:
    tokens = list(range(8))
    other_model = kv_namespace("other", "float32", 4)
    other_dtype = kv_namespace("SmolLM2-135M-Instruct", "bfloat16", 4)
    keys = {tuple(block_keys(tokens, 4, ns)) for ns in (NS, other_model, other_dtype)}
    assert len(keys) == 3


def test_deterministic_across_calls() -> None:
    tokens = [random.randrange(50_000) for _ in range(100)]
    assert block_keys(tokens, 16, NS) == block_keys(tuple(tokens), 16, NS)


def test_invalid_input() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        block_keys([1, 2], 0, NS)
    with pytest.raises(ValueError, match="32-bit"):
        block_keys([2**40] * 4, 4, NS)


def test_fast_for_long_prompts() -> None:
    tokens = [random.randrange(50_000) for _ in range(10_000)]
    block_keys(tokens, 16, NS)
    start = time.perf_counter()
    for _ in range(10):
        block_keys(tokens, 16, NS)
    per_call = (time.perf_counter() - start) / 10
    assert per_call < 0.02  # ~0.5 ms measured; generous bound for loaded CI machines
