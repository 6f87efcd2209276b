"""The AVX512-VNNI int8 linear: the quantization it documents, row by row, on any team size."""

from __future__ import annotations

import pytest
import torch

from mooncake_server.engine.kernel_choice import MAX_KERNEL_ERROR, kernel_errors
from mooncake_server.engine.vnni_linear import (
    VnniInt8Linear,
    quantize_rows,
    quantize_weight,
    vnni_supported,
)

pytestmark = pytest.mark.skipif(not vnni_supported(), reason="this CPU has no AVX512-VNNI")


def _reference(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: int8 rows times int8 channels, scaled back."""
    q, scale = quantize_weight(linear.weight)
    xq, xscale = quantize_rows(x)
    y = (xq.double() @ q.double().T) * (xscale.double() * scale.double())
    return y if linear.bias is None else y + linear.bias.detach().double()


@pytest.mark.parametrize(("n", "k", "bias"), [(96, 64, True), (100, 70, False), (40, 200, True)])
def test_output_is_the_documented_quantization(n: int, k: int, bias: bool) -> None:
    """Any width (padded blocks) and row count (passes of 16 rows and a remainder)."""
    torch.manual_seed(n + k)
    linear = torch.nn.Linear(k, n, bias=bias)
    kernel = VnniInt8Linear(linear)
    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(rows, k) * 3
        got = kernel(x)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _reference(linear, x), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_rest_of_its_call_or_the_team_size() -> None:
    """A token's logits must not move with what shares its decode step (fbgemm's one scale per
    call makes them move); each output is summed by one thread in one order."""
    torch.manual_seed(1)
    kernel = VnniInt8Linear(torch.nn.Linear(192, 160))
    row = torch.randn(1, 192)
    alone = kernel(row)
    threads = torch.get_num_threads()
    try:
        for team in (1, 2):
            torch.set_num_threads(team)
            batch = torch.cat([torch.randn(6, 192) * 50, row, torch.randn(12, 192)])
            assert torch.equal(kernel(batch)[6:7], alone)
    finally:
        torch.set_num_threads(threads)


def test_zero_and_nan_rows_stay_in_their_row() -> None:
    linear = torch.nn.Linear(64, 32)
    kernel = VnniInt8Linear(linear)
    x = torch.randn(3, 64)
    x[0] = 0.0
    x[2, 7] = float("nan")
    y = kernel(x)
    assert torch.equal(y[0], linear.bias.detach())
    assert torch.isfinite(y[1]).all() and torch.isnan(y[2]).all()


def test_keeps_batch_dimensions_and_stays_near_float32() -> None:
    linear = torch.nn.Linear(128, 256)
    kernel = VnniInt8Linear(linear)
    x = torch.randn(2, 3, 128)
    assert kernel(x).shape == (2, 3, 256)
    assert 0 < kernel_errors([linear], ["int8-vnni"])["int8-vnni"] < MAX_KERNEL_ERROR / 5
