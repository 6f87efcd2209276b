"""Next-token selection: greedy, temperature, top-p, with per-request seeded generators."""

from __future__ import annotations

import torch

from mooncake_server.wire.jobs import SamplingParams

# NOTE: dividing by a temperature this close to 0 overflows float32 logits to inf (NaN probs);
# such a temperature means greedy anyway.
MIN_TEMPERATURE = 1e-5


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None) -> int:
    """Pick one token from `logits` [vocab] (float32)."""
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
