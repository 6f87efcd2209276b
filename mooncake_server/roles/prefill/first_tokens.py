"""A computed prompt's first output token for each of its choices (`n`), drawn where its last
row's logits are: on the prefill instance, so the client has it before the KV hand-off."""

from __future__ import annotations

import torch

from mooncake_server.engine.logprobs import token_logprob
from mooncake_server.engine.sampler import sample_token
from mooncake_server.engine.sequence import Sequence
from mooncake_server.wire.jobs import FirstToken, PrefillJob


def first_tokens(job: PrefillJob, seq: Sequence, logits: torch.Tensor) -> list[FirstToken]:
    """Each choice's first token from the prompt's last row `logits` [vocab]."""
    adjusted = seq.next_token_logits(logits)  # NOTE: no output yet: the same for every choice
    top = job.sampling.logprobs
    firsts = []
    for i in range(job.sampling.n):
        params = job.sampling.for_choice(i)
        # Choice 0 draws from the sequence's own generator; a seeded later choice from its own.
        generator = seq.generator if i == 0 or params.seed is None else (
            torch.Generator().manual_seed(params.seed))
        token = sample_token(adjusted, params, generator)
        firsts.append(FirstToken(token_id=token, logprob=None if top is None
                                 else token_logprob(logits, token, top)))
    return firsts
