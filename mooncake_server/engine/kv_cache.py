"""The paged KV cache: one block layout shared by the attention kernels, the store and the wire.

A block holds `block_tokens` tokens of every layer's K and V:

    pool: [num_blocks, num_layers, 2 (K, V), kv_heads, block_tokens, head_dim]   (model dtype)

so block i is one contiguous byte range `[base + i * block_bytes, base + (i + 1) * block_bytes)`.
The transfer engine moves exactly those bytes to and from the store; nothing is re-packed.
Heads are outside tokens so that a head's run of `block_tokens` keys is contiguous: gathering a
sequence's blocks run by run yields [kv_heads, tokens, head_dim] ready for a matmul, with no
second copy to bring the heads forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block for a given model, block size and dtype."""

    num_layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: [layers, 2, kv_heads, block_tokens, head_dim]."""
        return (self.num_layers, 2, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_tokens)

    @classmethod
    def from_model_config(cls, config: object, block_tokens: int, dtype: torch.dtype) -> KVLayout:
        """Derive the layout from a HF model config (Llama/Qwen2/Mistral style attributes)."""
        heads = config.num_attention_heads  # type: ignore[attr-defined]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, block_tokens, dtype)  # type: ignore[attr-defined]


def prompt_cut(start: int, pending: int, budget: int, block_tokens: int, *,
               first: bool) -> int:
    """Prompt tokens a pass computes from position `start` (`pending` left) within `budget`:
    all of them, or as many as end on a block boundary (`first`: no other prompt is in the
    pass, so it takes at least up to the next boundary rather than none)."""
    # NOTE: a cut inside a block changes the bits of that block's KV and of every block after
    # it (attention over cached blocks sums in another order than within one pass). Blocks are
    # stored under keys of their tokens alone: two requests sharing a prefix, cut differently,
    # wrote two copies of one key, the store kept the first, and the other request's decode
    # found its KV was not its prefill's (it answered 503). Cut on boundaries, the bundled
    # model's blocks come out bit-identical (measured up to 256 tokens of context; past that
    # torch's attention kernel splits the keys by the pass's query length, and a decode given
    # another copy recomputes from it: roles/decode/app.py).
    if pending <= budget:
        return pending
    end = (start + budget) // block_tokens * block_tokens
    if end <= start:
        end = (start // block_tokens + 1) * block_tokens if first else start
    return min(pending, end - start)


class OutOfBlocks(Exception):
    """Raised when the cache has fewer free blocks than asked for."""


class PagedKVCache:
    """A pool of KV blocks over a caller-provided buffer (shared memory for the transfer engine)."""

    def __init__(self, layout: KVLayout, buffer: memoryview | bytearray | None = None,
                 num_blocks: int | None = None) -> None:
        self.layout = layout
        if buffer is None:
            if num_blocks is None:
                raise ValueError("PagedKVCache needs a buffer or num_blocks")
            buffer = bytearray(num_blocks * layout.block_bytes)
        self.num_blocks = len(buffer) // layout.block_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"KV memory of {len(buffer)} bytes holds no block of {layout.block_bytes} bytes")
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=self.num_blocks * layout.block_bytes)
        # NOTE: keep the buffer alive as long as the tensor views into it.
        self._buffer = buffer
        self.pool = raw.view(layout.dtype).view(self.num_blocks, *layout.block_shape)
        # The same memory as rows of one token's K (or V) of one head: where new tokens go.
        self.head_rows = self.pool.view(-1, layout.head_dim)
        # ... and as one head's run of a block's K (or V): what attention gathers context by.
        self.head_runs = self.pool.view(-1, layout.block_tokens * layout.head_dim)
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))

    @property
    def base_addr(self) -> int:
        """Address of block 0 (registered with the transfer engine)."""
        return self.pool.data_ptr()

    @property
    def num_free(self) -> int:
        """Blocks not held by any sequence."""
        return len(self._free)

    def block_addr(self, block_id: int) -> int:
        """Absolute address of a block's first byte."""
        return self.base_addr + block_id * self.layout.block_bytes

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks or raise OutOfBlocks without taking any."""
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        """Return blocks to the pool."""
        self._free.extend(reversed(block_ids))
