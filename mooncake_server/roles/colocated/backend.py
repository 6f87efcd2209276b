"""A `Backend` over an in-process engine loop: prefill and decode in one batch, no store hop."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mooncake_server.api.backend import BackendError, GenerateRequest, TokenEvent
from mooncake_server.engine.loop import EngineLoop
from mooncake_server.engine.sequence import LATE_FOR_SLO, SeqStatus, Sequence
from mooncake_server.roles.colocated.admission import ColocatedAdmission


class LocalEngineBackend:
    """The colocated baseline: the same engine loop, prompts prefilled in chunks between decodes."""

    def __init__(self, loop: EngineLoop, max_model_len: int,
                 admission: ColocatedAdmission | None = None) -> None:
        self.loop = loop
        self.max_model_len = max_model_len
        self.admission = admission  # with --ttft-slo / --tbt-slo

    def ready(self) -> bool:
        """Always ready once built."""
        return True

    def _choices(self, request: GenerateRequest) -> list[Sequence]:
        """One sequence per choice; choice 0 computes the prompt, the others fork from it."""
        prompt, sampling = request.prompt_token_ids, request.sampling
        lead = Sequence(request.request_id, list(prompt), len(prompt), sampling.for_choice(0),
                        self.max_model_len)
        if sampling.prompt_logprobs is not None:
            lead.prompt_logprobs = [None]
        for i in range(1, sampling.n):
            lead.forks.append(Sequence(f"{request.request_id}/{i}", list(prompt), len(prompt),
                                       sampling.for_choice(i), self.max_model_len,
                                       events=lead.events, choice=i))
        return [lead, *lead.forks]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Submit the prompt and stream its choices' tokens; closing the iterator cancels it."""
        seqs = self._choices(request)
        lead = seqs[0]
        if self.loop.kv.layout.blocks_for(lead.prompt_len + 1) > self.loop.kv.num_blocks:
            raise BackendError("prompt does not fit in the KV cache", status=400)
        ended = 0
        prompt_logprobs = lead.prompt_logprobs  # sent once, with choice 0's first token
        try:
            if self.admission is not None:
                await self.admission.admit(request, seqs)  # 429 here, before any work
            else:
                self.loop.submit(lead)
            while ended < len(seqs):
                ev = await lead.events.get()  # NOTE: shared by every choice
                if ev is None:
                    ended += 1
                    failed = next((s.error for s in seqs if s.error), None)
                    if failed == LATE_FOR_SLO:
                        raise BackendError(f"server overloaded: {failed}", status=429,
                                           code="slo_unattainable", retry_after_s=1.0)
                    if failed:
                        raise BackendError(failed, status=503)
                    continue
                scored = None
                if ev.choice == 0:
                    scored, prompt_logprobs = prompt_logprobs, None
                yield TokenEvent(token_id=ev.token_id, finish_reason=ev.finish_reason,
                                 logprob=ev.logprob, choice=ev.choice, prompt_logprobs=scored)
        finally:
            for seq in seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self.loop.cancel(seq)
