"""`--dtype auto` scores like float32 on the shipped text, on every CPU; and the scoring math.

auto runs int8-weights (AVX2+FMA) or float32, so its bounds hold everywhere; the kernels that
quantize activations are scored by scripts/bench_quality.py, not held to them.
"""

from __future__ import annotations

import math

import pytest
import torch

from mooncake_server.model_assets import resolve_model
from mooncake_testkit import quality as q


def _logprobs(*rows: tuple[float, ...]) -> torch.Tensor:
    """Log-probs [positions, vocab] from rows of probabilities."""
    return torch.tensor(rows, dtype=torch.float32).log()


def test_compare_identical_inputs() -> None:
    ref = [_logprobs((0.7, 0.2, 0.1), (0.1, 0.3, 0.6))]
    s = q.compare(ref, [ref[0].clone()], [[0, 1, 2]])
    assert (s.mean_kl, s.p99_kl, s.top1_agree, s.ppl_ratio, s.positions) == (0, 0, 1.0, 1.0, 2)
    # NLL of the true tokens 1 then 2: 0.2 and 0.6
    assert s.perplexity == pytest.approx(1 / math.sqrt(0.2 * 0.6), rel=1e-6)


def test_compare_shifted_by_hand() -> None:
    # Position 0 (true token 0): the mode moves mass from token 0 to 1 and its top-1 flips.
    # Position 1 (true token 1): both agree exactly.
    ref = _logprobs((0.6, 0.4), (0.9, 0.1))
    mode = _logprobs((0.3, 0.7), (0.9, 0.1))
    s = q.compare([ref], [mode], [[5, 0, 1]])
    kl0 = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)  # 0.19204 nats
    assert s.mean_kl == pytest.approx(kl0 / 2, rel=1e-5)
    assert s.p99_kl == pytest.approx(0.99 * kl0, rel=1e-5)  # linear between 0 and kl0
    assert s.top1_agree == 0.5
    # ppl = exp(mean NLL): ref 1/sqrt(0.6 * 0.1), mode 1/sqrt(0.3 * 0.1): ratio sqrt(2)
    assert s.ref_perplexity == pytest.approx(1 / math.sqrt(0.06), rel=1e-5)
    assert s.ppl_ratio == pytest.approx(math.sqrt(2), rel=1e-5)


def test_windows_are_fixed_spaced_and_disjoint() -> None:
    tokens = list(range(1000))
    wins = q.windows(tokens, 100, 4)
    assert [w[0] for w in wins] == [0, 300, 600, 900] and all(len(w) == 100 for w in wins)
    assert q.windows(tokens, 100, 4) == wins
    with pytest.raises(ValueError):
        q.windows(tokens, 100, 11)


@pytest.fixture(scope="module")
def model_path() -> str:
    """The converted default model."""
    return resolve_model(None)


@pytest.mark.parametrize("mode", ["auto", "served"])
def test_auto_scores_like_float32(model_path: str, mode: str) -> None:
    """The default kernel in HF's modules, and the engine's whole default forward (its native
    norms and 4-bit linears), stay within auto's bounds of float32."""
    from transformers import AutoTokenizer

    tokens = q.load_text_tokens(AutoTokenizer.from_pretrained(model_path))
    assert len(tokens) >= 24_000  # bench_quality's default windows fit
    wins = q.windows(tokens, 256, 2)
    ref_model, _ = q.build_mode(model_path, "float32")
    ref = q.teacher_forced(ref_model, wins)
    del ref_model
    auto_model, emulated = q.build_mode(model_path, mode)
    assert not emulated
    s = q.compare(ref, q.teacher_forced(auto_model, wins), wins)
    assert s.positions == 2 * 255
    assert s.top1_agree >= q.AUTO_MIN_TOP1, (s, auto_model.linears_note)
    assert s.mean_kl <= q.AUTO_MAX_MEAN_KL, (s, auto_model.linears_note)
    assert abs(s.ppl_ratio - 1) <= q.AUTO_MAX_PPL_DRIFT, (s, auto_model.linears_note)
