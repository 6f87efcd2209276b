"""An int8 linear for decode-sized calls on AVX512-VNNI CPUs (native/linear/int8_vnni.c).

fbgemm's dynamic int8 linear is a GEMM: on one-row calls it streamed int8 weights at ~13 GB/s
here, slower than float32's GEMV. This kernel is a GEMV for up to a few dozen rows: weights
int8 per output channel, packed for VPDPBUSD; activations 8-bit per row over the row's own range
(asymmetric, round half to even; fbgemm's are 7-bit over the whole call). Teacher-forced on
SmolLM2's greedy answers to five chat questions (248 one-token steps, lm_head fp16 in both), its
next token agreed with float32's at 94% of steps against fbgemm's 79%. Per-row scales make a
row's output independent of what shares its call, and each output is summed by one thread in
one order, so the result does not depend on the team size either.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    from mooncake_server.engine import _int8_vnni  # type: ignore[attr-defined]
except ImportError:  # built only on x86-64
    _int8_vnni = None

BLOCK_N = 16  # output channels per packed block
K_ALIGN = 64  # packed input width is a multiple of this


def vnni_supported() -> bool:
    """The kernel is built and this CPU has AVX512F, AVX512BW and AVX512-VNNI."""
    return _int8_vnni is not None and bool(_int8_vnni.supported())


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 weight, float32 scale per channel)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel does to its input rows, in torch: (levels less the row's zero point, as
    floats; scale per row). Each row's range, widened to hold 0, spans 255 levels."""
    lo = x.amin(dim=-1, keepdim=True).clamp_max(0)
    span = x.amax(dim=-1, keepdim=True).clamp_min(0) - lo
    inv = 255.0 / span
    zero = torch.round(-lo * inv).clamp(0, 255)
    q = (torch.round(x * inv) + zero).clamp(0, 255) - zero
    return torch.where(span > 0, q, 0.0), span / 255


class VnniInt8Linear(nn.Module):
    """y = x @ W.T + b with int8 weights and per-row int8 activations (float32 in and out)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not vnni_supported():
            raise RuntimeError("the int8 VNNI kernel needs AVX512-VNNI")
        self.out_features, self.in_features = n, k = linear.weight.shape
        q, scale = quantize_weight(linear.weight)
        n_pad, self.k_pad = -(-n // BLOCK_N) * BLOCK_N, -(-k // K_ALIGN) * K_ALIGN
        padded = torch.zeros(n_pad, self.k_pad, dtype=torch.int8)
        padded[:n, :k] = q
        # [N/16][K/4][16][4]: one 64-byte load is 16 channels x 4 inputs, VPDPBUSD's operand
        packed = padded.view(n_pad // BLOCK_N, BLOCK_N, self.k_pad // 4, 4).permute(0, 2, 1, 3)
        self.register_buffer("packed", packed.contiguous(), persistent=False)
        # A row's zero point adds zero * sum(w) to each channel's dot: taken off after.
        self.register_buffer("sums", _padded(q.sum(dim=1, dtype=torch.int32), n_pad),
                             persistent=False)
        self.register_buffer("scale", _padded(scale, n_pad), persistent=False)
        bias = None if linear.bias is None else _padded(linear.bias.detach().float(), n_pad)
        self.register_buffer("bias", bias, persistent=False)
        self._args = (self.packed.data_ptr(), n, self.scale.data_ptr(), self.sums.data_ptr(),
                      0 if bias is None else bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """float32 in, float32 out; each row quantized on its own."""
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.empty(rows.shape[0], self.out_features)
        weight, n, scale, sums, bias = self._args
        _int8_vnni.linear(rows.data_ptr(), rows.shape[0], self.in_features, self.k_pad, weight, n,
                          scale, sums, bias, y.data_ptr())
        return y.view(*x.shape[:-1], self.out_features)


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t` followed by zeros up to length `n` (packed blocks are whole)."""
    out = torch.zeros(n, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out
