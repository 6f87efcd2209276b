"""Next-token selection: a request's logit rules, then greedy, temperature, top-p, with
per-request seeded generators."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake_server.wire.jobs import SamplingParams

# NOTE: dividing by a temperature this close to 0 overflows float32 logits to inf (NaN probs);
# such a temperature means greedy anyway.
MIN_TEMPERATURE = 1e-5


class LogitRules:
    """One request's logit adjustments, applied in this order to the model's logits [vocab]:

    1. repetition_penalty p (vLLM / HF): a token seen in the prompt or the output so far has its
       logit divided by p if positive, multiplied by p otherwise;
    2. frequency and presence penalties (OpenAI): logit -= frequency * count + presence *
       (count > 0), count = occurrences in the OUTPUT so far;
    3. logit_bias (OpenAI): the bias is added;
    4. min_tokens (vLLM): EOS ids get -inf while fewer than min_tokens tokens were produced.

    Counts are kept on the logits' device and updated with only the tokens appended since the
    last call, so a step costs a few [vocab] vector ops whatever the history's length. Output
    tokens this instance did not sample (the prefill's first token, a moved request's tokens)
    are counted on the first call.
    """

    def __init__(self, params: SamplingParams, token_ids: Sequence[int], prompt_len: int) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self._prompt_ids = list(token_ids[:prompt_len]) if params.repetition_penalty != 1.0 else []
        self._counted = prompt_len  # tokens of the history already in _counts / _seen
        self._counts: torch.Tensor | None = None  # [vocab] float32: output occurrences
        self._seen: torch.Tensor | None = None  # [vocab] bool: in the prompt or the output
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, values)
        self._started = False

    def apply(self, logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """The adjusted logits [vocab] (a new tensor); `token_ids` = prompt + output so far."""
        p = self.params
        vocab = logits.shape[-1]
        self._catch_up(logits, token_ids)
        out = logits.float().clone()
        if self._seen is not None:
            rp = p.repetition_penalty
            out = torch.where(self._seen, torch.where(out > 0, out / rp, out * rp), out)
        if self._counts is not None:
            out -= self._counts * p.frequency_penalty + (self._counts > 0) * p.presence_penalty
        if p.logit_bias:
            if self._bias is None:
                if max(p.logit_bias) >= vocab or min(p.logit_bias) < 0:
                    raise ValueError(f"logit_bias names a token id outside the vocabulary "
                                     f"(0..{vocab - 1})")
                self._bias = (torch.tensor(list(p.logit_bias), device=logits.device),
                              torch.tensor(list(p.logit_bias.values()), device=logits.device))
            out.index_add_(0, *self._bias)
        produced = len(token_ids) - self.prompt_len
        if produced < p.min_tokens and not p.ignore_eos:
            eos = [t for t in p.eos_token_ids if 0 <= t < vocab]
            if eos:
                out[eos] = float("-inf")
        return out

    def _catch_up(self, logits: torch.Tensor, token_ids: Sequence[int]) -> None:
        p = self.params
        vocab, device = logits.shape[-1], logits.device
        if not self._started:
            self._started = True
            if p.repetition_penalty != 1.0:
                self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                self._seen[self._valid(self._prompt_ids, vocab, device)] = True
            if p.frequency_penalty or p.presence_penalty:
                self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if len(token_ids) <= self._counted or (self._seen is None and self._counts is None):
            return
        ids = self._valid(token_ids[self._counted:], vocab, device)
        self._counted = len(token_ids)
        if self._seen is not None:
            self._seen[ids] = True
        if self._counts is not None:
            self._counts.index_put_((ids,), torch.ones_like(ids, dtype=torch.float32),
                                    accumulate=True)

    @staticmethod
    def _valid(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        return torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long, device=device)


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> int:
    """Pick one token from `logits` [vocab] (float32; already through the request's rules)."""
    if params.greedy or params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = cumulative - sorted_probs < params.top_p
        keep[0] = True  # NOTE: a top_p below float32's smallest value would otherwise keep none
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(sorted_ids[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())
