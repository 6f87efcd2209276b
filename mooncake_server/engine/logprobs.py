"""Log-probabilities of sampled and prompt tokens, computed only for requests that ask.

They are of the model's RAW distribution: `log_softmax` of the logits as the forward pass gave
them, before temperature, top-p, penalties, logit_bias or min_tokens (vLLM's default,
`raw_logprobs`; OpenAI's are of the model too). So the same token under the same prefix scores
the same whatever the sampling fields, which is what a harness comparing answers needs.

Prompt scoring (`echo` with `logprobs`) needs the logits of EVERY prompt row, not only the
last: the runner keeps those rows for the sequences that score their prompt
(`Sequence.scores_prompt`) after the one last row per item, in item order
(`extra_rows_per_item`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from mooncake_server.engine.sequence import Sequence
from mooncake_server.wire.jobs import TokenLogprob


def _entries(logprobs: torch.Tensor, targets: torch.Tensor, top: int) -> list[TokenLogprob]:
    """TokenLogprob per row of `logprobs` [rows, vocab] for the target ids [rows]."""
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    ids = targets.tolist()
    if top <= 0:
        return [TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(ids, chosen)]
    values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
    return [TokenLogprob(token_id=t, logprob=lp, top=list(zip(i, v)))
            for t, lp, i, v in zip(ids, chosen, indices.tolist(), values.tolist())]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The sampled `token`'s entry from the raw `logits` [vocab] of its step."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)[None]
    return _entries(logprobs, torch.tensor([token]), top)[0]


def extra_rows_per_item(items: Seq[tuple[Sequence, int]]) -> list[int]:
    """How many rows after the last-row block the runner kept for each (seq, num_new) item."""
    return [n if seq.scores_prompt else 0 for seq, n in items]


def score_prompt_chunks(items: Seq[tuple[Sequence, int]], logits: torch.Tensor) -> None:
    """Append the prompt entries of each scoring item's chunk to `seq.prompt_logprobs`.

    Call BEFORE `num_computed` advances: row j of a chunk starting at position s predicts
    token s + j + 1; the last prompt row predicts the first output token and is skipped here.
    `logits` = the runner's output: one row per item, then the kept rows in item order.
    """
    at = len(items)
    for (seq, n), extra in zip(items, extra_rows_per_item(items)):
        if not extra:
            continue
        rows = logits[at:at + extra]
        at += extra
        start = seq.num_computed
        targets = seq.token_ids[start + 1:min(start + n + 1, seq.prompt_len)]
        if not targets or seq.prompt_logprobs is None:
            continue
        logprobs = torch.log_softmax(rows[:len(targets)].float(), dim=-1)
        top = seq.sampling.prompt_logprobs or 0
        seq.prompt_logprobs += _entries(logprobs, torch.tensor(targets), top)
