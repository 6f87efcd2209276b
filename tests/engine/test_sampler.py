"""sample_token: sampled tokens follow the tempered softmax, inside top_p's nucleus."""

from __future__ import annotations

import pytest
import torch

from mooncake_server.engine.sampler import NUCLEUS_TRIES, draw, nucleus, sample_token
from mooncake_server.wire.jobs import SamplingParams

DRAWS = 40_000


def sampled(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=8, **kw)  # type: ignore[arg-type]


def frequencies(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """How often each token came out of DRAWS seeded draws, as fractions."""
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(logits.numel())
    for _ in range(DRAWS):
        counts[sample_token(logits, params, gen)] += 1
    return counts / DRAWS


def reference_nucleus(weights: torch.Tensor, top_p: float) -> set[int]:
    """The definition, over the whole sorted vocabulary."""
    probs = weights / weights.sum()
    values, ids = torch.sort(probs, descending=True)
    keep = values.cumsum(0) - values < top_p
    keep[0] = True
    return set(ids[keep].tolist())


def test_sampled_tokens_follow_the_tempered_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5])
    freq = frequencies(logits, sampled(temperature=0.8))
    expected = torch.softmax(logits / 0.8, dim=0)
    assert freq[4] == 0  # a banned token never comes out
    # 40k draws: a fraction's standard error is under 0.0025; 0.01 is four of them
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_top_p_draws_only_from_the_nucleus_in_proportion() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    freq = frequencies(probs.log(), sampled(temperature=1.0, top_p=0.75))
    # sorted 0.5, 0.3 | 0.15, 0.05: the mass before 0.15 is 0.8 >= 0.75, so two tokens stay
    assert freq[0] == 0 and freq[2] == 0
    assert freq[1] == pytest.approx(0.5 / 0.8, abs=0.01)
    assert freq[3] == pytest.approx(0.3 / 0.8, abs=0.01)


@pytest.mark.parametrize("spread", [12.0, 3.0, 0.3])  # peaked (fast path) .. flat (full sort)
@pytest.mark.parametrize("top_p", [1e-9, 0.5, 0.9, 0.999])
def test_the_nucleus_is_the_sorted_definition_whatever_its_size(spread: float,
                                                                top_p: float) -> None:
    gen = torch.Generator().manual_seed(int(spread * 10) + int(top_p * 1000))
    weights = torch.exp(torch.randn(49_152, generator=gen) * spread)
    kept, ids = nucleus(weights, top_p)
    assert set(ids.tolist()) == reference_nucleus(weights, top_p)
    assert torch.equal(kept, weights[ids])
    assert bool((kept[:-1] >= kept[1:]).all())  # heaviest first


def test_both_nucleus_paths_are_exercised_by_the_cases_above() -> None:
    """The parametrised cases cover a nucleus inside the first try and one past the last."""
    sizes = []
    for spread in (12.0, 0.3):
        gen = torch.Generator().manual_seed(int(spread * 10) + 900)
        weights = torch.exp(torch.randn(49_152, generator=gen) * spread)
        sizes.append(len(reference_nucleus(weights, 0.9)))
    assert sizes[0] < NUCLEUS_TRIES[0] and sizes[1] > NUCLEUS_TRIES[-1]


def test_draw_never_picks_a_zero_weight() -> None:
    weights = torch.zeros(1000)
    weights[[3, 500, 999]] = torch.tensor([1e-30, 2.0, 1.0])
    gen = torch.Generator().manual_seed(5)
    picks = {draw(weights, gen) for _ in range(2000)}
    assert picks == {500, 999}  # 1e-30 of the mass: never in 2000 draws


def test_no_finite_probability_is_an_error_not_a_token() -> None:
    with pytest.raises(ValueError, match="positive, finite"):
        sample_token(torch.full((8,), float("-inf")), sampled(temperature=1.0))


def test_a_seed_gives_the_same_tokens() -> None:
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(0)) * 4
    params = sampled(temperature=0.7, top_p=0.9)
    runs = [[sample_token(logits, params, gen) for _ in range(20)]
            for gen in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
