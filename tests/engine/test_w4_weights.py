"""A Q4_1 GGUF's linears (the bundled model's) run in 4 bits, multiplying by their own floats."""

from __future__ import annotations

import pytest
import torch

from mooncake_server.engine.w8_linear import W8Linear, dequantized, w8_supported
from mooncake_testkit.quality import q4_1

pytestmark = pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")


def q4_linear(k: int = 96, n: int = 71, bias: bool = True) -> torch.nn.Linear:
    """A linear (odd width: a padded block) whose weights sit on a Q4_1 grid."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(q4_1(lin.weight))
    return lin


def test_a_q4_1_linear_is_kept_in_four_bits_and_multiplies_by_its_own_weights() -> None:
    lin = q4_linear(bias=False)
    w4 = W8Linear(lin)
    assert w4.bits == 4
    assert w4.packed.numel() == 72 * 96 // 2  # half a byte a weight (71 channels padded to 72)
    eye = torch.eye(96)
    # Each unit row reads one input's weights back: exactly the model's floats, through the
    # many-row path (dequantized slabs) and the few-row path (nibbles in registers) alike.
    assert torch.equal(w4(eye), lin.weight.detach().T)
    for i in (0, 17, 95):
        assert torch.equal(w4(eye[i:i + 1]), lin.weight.detach().T[i:i + 1])
    assert torch.equal(dequantized(lin.weight), lin.weight.detach())


def test_a_row_gets_the_same_floats_alone_or_beside_others_in_four_bits() -> None:
    lin = q4_linear()
    w4 = W8Linear(lin)
    x = torch.randn(9, 96)
    together = w4(x)
    for r in range(9):
        assert torch.equal(w4(x[r:r + 1]), together[r:r + 1])
    assert torch.equal(w4(x[2:5]), together[2:5])  # a 3-row call: the narrow path
    with torch.no_grad():
        torch.testing.assert_close(together, lin(x), rtol=1e-5, atol=1e-5)


def test_weights_off_a_sixteen_level_grid_stay_in_bytes() -> None:
    assert W8Linear(torch.nn.Linear(96, 40)).bits == 8
    lin = q4_linear()
    with torch.no_grad():
        lin.weight[5, 40] += 1e-3  # one weight between levels: that group has no 4-bit form
    assert W8Linear(lin).bits == 8
