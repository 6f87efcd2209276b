"""LogitRules: each field changes a row of logits exactly as its definition says."""

from __future__ import annotations

import random

import pytest
import torch

from mooncake_server.engine.sampler import LogitRules, sample_token
from mooncake_server.engine.sequence import Sequence
from mooncake_server.wire.jobs import SamplingParams

VOCAB = 16
EOS = 15


def params(**kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=64, temperature=0.0, eos_token_ids=[EOS], **kw)


def rules_after(p: SamplingParams, prompt: list[int], output: list[int],
                logits: torch.Tensor) -> torch.Tensor:
    return LogitRules(p, prompt + output, len(prompt)).apply(logits, prompt + output)


def test_frequency_and_presence_count_output_tokens_only() -> None:
    logits = torch.zeros(VOCAB)
    out = rules_after(params(frequency_penalty=0.5, presence_penalty=1.5), prompt=[3, 3, 4],
                      output=[4, 5, 5, 5], logits=logits)
    expected = torch.zeros(VOCAB)
    expected[4] = -(0.5 * 1 + 1.5)  # once in the output (its prompt occurrence does not count)
    expected[5] = -(0.5 * 3 + 1.5)
    assert torch.equal(out, expected)  # token 3, only in the prompt: untouched


def test_negative_penalties_favour_repeats() -> None:
    out = rules_after(params(frequency_penalty=-1.0), [1], [2, 2], torch.zeros(VOCAB))
    assert out[2] == 2.0 and int(out.argmax()) == 2


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output() -> None:
    logits = torch.tensor([float(i % 5) - 2.0 for i in range(VOCAB)])  # -2..2 repeating
    out = rules_after(params(repetition_penalty=2.0), prompt=[3, 4], output=[0, 4], logits=logits)
    expected = logits.clone()
    expected[3] = logits[3] / 2  # +1: prompt token, positive -> divided
    expected[4] = logits[4] / 2  # +2: in both, penalised once
    expected[0] = logits[0] * 2  # -2: output token, negative -> multiplied
    assert torch.equal(out, expected)


def test_logit_bias_is_added_and_extremes_force_or_ban() -> None:
    logits = torch.linspace(0, 1, VOCAB)  # greedy = VOCAB - 1
    out = rules_after(params(logit_bias={2: 100.0, 7: -3.5}), [1], [], logits)
    assert out[7] == pytest.approx(float(logits[7]) - 3.5)
    assert sample_token(out, params()) == 2
    banned = rules_after(params(logit_bias={VOCAB - 1: -100.0}), [1], [], logits)
    assert sample_token(banned, params()) == VOCAB - 2


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rules_after(params(logit_bias={VOCAB: 1.0}), [1], [], torch.zeros(VOCAB))


def test_min_tokens_masks_eos_until_enough_tokens_were_produced() -> None:
    logits = torch.zeros(VOCAB)
    logits[EOS] = 10.0
    p = params(min_tokens=2)
    assert rules_after(p, [1], [], logits)[EOS] == float("-inf")
    assert rules_after(p, [1], [4], logits)[EOS] == float("-inf")
    assert rules_after(p, [1], [4, 5], logits)[EOS] == 10.0
    # with ignore_eos, EOS is no stop token, so there is nothing to hold back
    assert not params(min_tokens=2, ignore_eos=True).adjusts_logits


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_incremental_counts_equal_counting_from_scratch(device: str) -> None:
    rnd = random.Random(0)
    p = params(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3,
               logit_bias={3: 2.5}, min_tokens=10)
    prompt = [rnd.randrange(VOCAB) for _ in range(5)]
    tokens = list(prompt)
    live = LogitRules(p, tokens, len(prompt))
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    for _ in range(30):
        # several tokens may arrive between calls (a prefill's first token, a moved request)
        tokens += [rnd.randrange(VOCAB) for _ in range(rnd.choice((1, 1, 3)))]
        fresh = LogitRules(p, tokens, len(prompt)).apply(logits, tokens)
        got = live.apply(logits, tokens)
        assert got.device == logits.device and torch.equal(got, fresh)


def test_without_rules_a_sequence_samples_the_models_logits_as_they_are() -> None:
    seq = Sequence("r", [1, 2], 2, params(), max_model_len=64)
    logits = torch.randn(VOCAB)
    assert seq.logit_rules is None
    assert seq.next_token_logits(logits) is logits  # the fast path: no copy, no extra op
    assert not params(min_tokens=0, frequency_penalty=0.0, repetition_penalty=1.0).adjusts_logits


def test_a_sequence_counts_tokens_it_did_not_sample() -> None:
    # a decode instance's Sequence starts with the prefill's first token already in it
    seq = Sequence("r", [1, 2, 9], 2, params(frequency_penalty=2.0), max_model_len=64)
    logits = torch.zeros(VOCAB)
    logits[9] = 1.0
    assert seq.next_token_logits(logits)[9] == -1.0
