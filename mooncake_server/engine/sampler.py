"""Next-token selection: a request's logit rules, then greedy, temperature, top-p, with
per-request seeded generators."""

from __future__ import annotations

import math
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
    scaled = logits.float() / params.temperature
    # softmax without its division: every step below compares or draws against the sum
    weights = torch.exp(scaled - scaled.max())
    if params.top_p < 1.0:
        kept, ids = nucleus(weights, params.top_p)
        return int(ids[draw(kept, generator)].item())
    return draw(weights, generator)


# Candidate counts tried for top_p before sorting the whole vocabulary. The nucleus of a chat
# token is mostly one to a few tokens, of an unlikely context hundreds to a few thousand
# (SmolLM2 at temperature 0.7, top_p 0.9); over 49k weights top-k takes 0.1 / 0.24 / 0.6 ms
# at these k, a full sort 3 ms.
NUCLEUS_TRIES = (64, 1024, 8192)


def nucleus(weights: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest heaviest prefix of `weights` [vocab] holding `top_p` of their sum, as
    (weights, token ids), heaviest first; at least one token."""
    limit = top_p * float(weights.sum())
    for k in NUCLEUS_TRIES:
        if k >= weights.numel():
            break
        values, ids = torch.topk(weights, k)
        cumulative = values.cumsum(0)
        # A token beyond the first k has at least cumulative[-1] before it: not kept then.
        if cumulative[-1] >= limit:
            return _prefix(values, ids, cumulative, limit)
    values, ids = torch.sort(weights, descending=True)
    return _prefix(values, ids, values.cumsum(0), limit)


def _prefix(values: torch.Tensor, ids: torch.Tensor, cumulative: torch.Tensor,
            limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted tokens whose preceding mass is below `limit`."""
    keep = cumulative - values < limit
    keep[0] = True  # NOTE: a top_p below float32's smallest value would otherwise keep none
    return values[keep], ids[keep]


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability weights[i] / sum(weights): one uniform, inverse CDF.

    torch.multinomial took 1 ms over a 49k vocabulary on these CPUs (per draw, on the engine
    loop); a float64 cumulative sum and a binary search take ~0.1 ms and draw from the same
    distribution.
    """
    cdf = weights.double().cumsum(0)
    total = float(cdf[-1])
    if not (total > 0.0 and math.isfinite(total)):
        raise ValueError("no token has a positive, finite probability")
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    index = int(torch.searchsorted(cdf, torch.tensor(u * total, dtype=torch.float64),
                                   right=True))
    if index >= cdf.numel():  # u * total rounded up to the total: the last token with weight
        index = int(weights.nonzero()[-1])
    return index
