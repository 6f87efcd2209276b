"""How far a linear kernel moves the default model from float32, scored on a shipped text.

Teacher-forced over fixed windows of The Devil's Dictionary (data/devils_dictionary.txt, public
domain): perplexity, KL(float32 || mode) per position and top-1 agreement; plus greedy
continuations of prompts from the same text. Kernels this CPU cannot run are scored by torch
emulations of their rounding ("emulated"), so every mode gets a number on every machine.
Used by scripts/bench_quality.py and tests/engine/test_quality.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_server.engine.linears import (
    INT8_ACTIVATIONS,
    KERNELS,
    OUTPUT_PROJECTION,
    bf16_packing_supported,
    fp16_weights_supported,
    prepare_linears,
)
from mooncake_server.engine.vnni_linear import quantize_rows, quantize_weight, vnni_supported
from mooncake_server.engine.w8_linear import dequantized, w8_fits, w8_supported

TEXT_FILE = "devils_dictionary.txt"
# The file's provenance header ends at this line; only what follows is scored.
TEXT_MARKER = "==== TEXT ====\n"

# What `auto` must keep on every CPU (it runs int8-weights or float32): bench_quality's targets.
AUTO_MIN_TOP1 = 0.99
AUTO_MAX_MEAN_KL = 0.002
AUTO_MAX_PPL_DRIFT = 0.005  # |ppl ratio - 1|

# Whether this machine runs a kernel natively; the others are emulated. "int8" is fbgemm's,
# present exactly where its fp16-weight linear is.
NATIVE: dict[str, Callable[[], bool]] = {
    "float32": lambda: True, "int8-weights": w8_supported, "bfloat16": bf16_packing_supported,
    "int8": fp16_weights_supported, "int8-vnni": vnni_supported,
    "fp16-weights": fp16_weights_supported}


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as a Q4_1 GGUF holds it, dequantized as transformers loads it: per group of 32
    inputs a float16 minimum m and step d, levels 0..15, each weight d * level + m in float32."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // 32, 32)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    m = lo.half().float()
    d = ((hi - lo) / 15).half().float()
    q = torch.round((w - m[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).clamp(0, 15)
    return (d[..., None] * q + m[..., None]).view(n, k)


def load_text() -> str:
    """The shipped text without its provenance header."""
    raw = resources.files("mooncake_testkit").joinpath("data", TEXT_FILE).read_text("ascii")
    return raw.split(TEXT_MARKER, 1)[1]


def load_text_tokens(tokenizer: Any) -> list[int]:
    """The shipped text as token ids, without special tokens."""
    return list(tokenizer(load_text(), add_special_tokens=False)["input_ids"])


def _starts(total: int, length: int, count: int) -> list[int]:
    """`count` evenly spaced starts of non-overlapping spans of `length` within `total`."""
    if count < 1 or length < 1 or count * length > total:
        raise ValueError(f"{count} spans of {length} tokens do not fit in {total}")
    # step >= length because count * length <= total: the spans never overlap.
    step = (total - length) // (count - 1) if count > 1 else 0
    return [i * step for i in range(count)]


def windows(tokens: Sequence[int], length: int, count: int) -> list[list[int]]:
    """`count` non-overlapping windows of `length` tokens, evenly spaced (the same every run)."""
    return [list(tokens[s:s + length]) for s in _starts(len(tokens), length, count)]


def prompts_from_text(tokens: Sequence[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens taken at evenly spaced places of the text."""
    return windows(tokens, length, count)


class EmulatedLinear(nn.Module):
    """float32 in and out; a kernel's rounding of weight, input and output, done in torch."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 round_input: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 round_output: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.contiguous(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.round_input, self.round_output = round_input, round_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """F.linear between the rounding steps."""
        if self.round_input is not None:
            x = self.round_input(x)
        y = F.linear(x, self.weight, self.bias)
        return y if self.round_output is None else self.round_output(y)


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """Rounded to bfloat16 and back."""
    return t.bfloat16().float()


def _vnni_input(x: torch.Tensor) -> torch.Tensor:
    """The VNNI kernel's 8-bit levels of each row, times the row's scale."""
    q, scale = quantize_rows(x)
    return q * scale


def _fbgemm_input(x: torch.Tensor) -> torch.Tensor:
    """fbgemm's dynamic activations: one 7-bit asymmetric scale for the whole call
    (reduce_range, as torch.ao sets it), picked by the same routine fbgemm's op calls."""
    scale, zero = torch._choose_qparams_per_tensor(x, True)
    return ((torch.round(x / scale) + zero).clamp(0, 127) - zero) * scale


def _fbgemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight as torch.ao's per-channel dynamic qconfig quantizes it (symmetric int8)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig

    observer = per_channel_dynamic_qconfig.weight()
    observer(weight)
    scale, zero = observer.calculate_qparams()
    # double scales and int64 zero points, as torch.ao's _quantize_weight passes them
    return torch.quantize_per_channel(weight, scale.double(), zero.long(), 0,
                                      torch.qint8).dequantize()


def emulated(kernel: str, linear: nn.Linear) -> nn.Module:
    """A torch stand-in for `kernel` on `linear`, for CPUs that cannot run the kernel."""
    w = linear.weight.detach().float()
    b = None if linear.bias is None else linear.bias.detach().float()
    if kernel == "int8-weights":
        # as KERNELS' int8_weights: linears that are not whole groups stay float32
        return EmulatedLinear(dequantized(w), b) if w8_fits(linear) else linear
    if kernel == "bfloat16":
        # oneDNN takes bf16 weight, bias and input, sums in float32 and returns bf16
        return EmulatedLinear(_bf16(w), None if b is None else _bf16(b), _bf16, _bf16)
    if kernel == "int8-vnni":
        q, scale = quantize_weight(w)
        return EmulatedLinear(q.float() * scale[:, None], b, _vnni_input)
    if kernel == "int8":
        return EmulatedLinear(_fbgemm_weight(w), b, _fbgemm_input)
    if kernel == "fp16-weights":
        return EmulatedLinear(w.half().float(), b)
    if kernel == "float32":
        return linear
    raise ValueError(f"unknown kernel {kernel!r}")


class ServedForward(nn.Module):
    """The engine's own `--dtype auto` forward (ModelRunner: the lean stack, its native norms
    and decode attention, 4-bit or grouped int8 linears) behind the two calls scoring makes of
    an HF model: a forward over a whole window, and greedy `generate`."""

    BLOCK_TOKENS = 16

    def __init__(self, path: str) -> None:
        super().__init__()
        from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
        from mooncake_server.engine.model_runner import ModelRunner, load_model

        model = load_model(path, torch.float32, "auto")
        layout = KVLayout.from_model_config(model.config, self.BLOCK_TOKENS, torch.float32)
        self.runner = ModelRunner(model, PagedKVCache(layout, num_blocks=256))
        self.linears_note = "engine forward, " + ", ".join(sorted(
            {f"{getattr(m, 'bits', 8)}-bit groups" for m in model.modules()
             if type(m).__name__ == "W8Linear"}))

    def _sequence(self, ids: list[int], extra: int, score: bool) -> Any:
        """A sequence of `ids` with blocks for `extra` more tokens."""
        from mooncake_server.engine.sequence import Sequence
        from mooncake_server.wire.jobs import SamplingParams

        seq = Sequence("quality", list(ids), len(ids), SamplingParams(max_tokens=max(1, extra)),
                       len(ids) + extra)
        if score:
            seq.prompt_logprobs = [None]
        kv = self.runner.kv
        seq.block_ids = kv.allocate(kv.layout.blocks_for(len(ids) + extra))
        return seq

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
        """Logits [1, L, vocab] of every position of the one row of `input_ids`."""
        from types import SimpleNamespace

        from mooncake_server.engine.model_runner import StepItem

        seq = self._sequence(input_ids[0].tolist(), 0, score=True)
        try:
            logits = self.runner.step([StepItem(seq, len(seq.token_ids))])
        finally:
            self.runner.kv.free(seq.block_ids)
        return SimpleNamespace(logits=logits[1:][None])  # row 0 repeats the last position

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **_: Any) -> torch.Tensor:
        """Greedy: a prompt pass, then one decode step per new token (EOS does not stop it)."""
        from mooncake_server.engine.model_runner import StepItem

        seq = self._sequence(input_ids[0].tolist(), max_new_tokens, score=False)
        try:
            new = len(seq.token_ids)
            for _ in range(max_new_tokens):
                logits = self.runner.step([StepItem(seq, new)])
                seq.num_computed += new
                seq.token_ids.append(int(logits[0].argmax()))
                new = 1
        finally:
            self.runner.kv.free(seq.block_ids)
        return torch.tensor([seq.token_ids])


def build_mode(path: str, mode: str) -> tuple[nn.Module, bool]:
    """The float32 HF model at `path` with `mode`'s kernels: (model, whether any is emulated).

    "auto" is the server's own choice (prepare_linears) in HF's modules, never emulated;
    "served" is the engine's whole default forward (ServedForward). Its description, and
    each mode's, is left in `model.linears_note`.
    """
    from transformers import AutoModelForCausalLM

    if mode == "served":
        return ServedForward(path), False

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if mode == "auto":
        model.linears_note = prepare_linears(model, torch.float32, "auto")
        return model, False
    if mode not in KERNELS:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(KERNELS)} or auto")
    used: set[tuple[str, bool]] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            kernel = mode
            # Served int8-activation modes keep 16-bit weights in the output projection
            # (linears.output_kernel); scored as served, emulated where fbgemm is missing.
            if parent is model and name == OUTPUT_PROJECTION and mode in INT8_ACTIVATIONS:
                kernel = "fp16-weights"
            native = NATIVE[kernel]()
            used.add((kernel, native))
            setattr(parent, name, KERNELS[kernel](child) if native else emulated(kernel, child))
    model.linears_note = ", ".join(f"{k} {'native' if n else 'emulated'}"
                                   for k, n in sorted(used))
    return model, any(not native for _, native in used)


def teacher_forced(model: nn.Module, windows: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per window, float32 log-probs [L-1, vocab]: position i predicts token i+1."""
    out = []
    with torch.inference_mode():
        for window in windows:
            logits = model(torch.tensor([list(window)]), use_cache=False).logits[0, :-1]
            out.append(torch.log_softmax(logits.float(), dim=-1))
            del logits  # a window's logits are as large as its log-probs (vocab x L floats)
    return out


@dataclass
class PositionStats:
    """Per scored position of one window: both modes' NLL of the true token, KL, top-1 match."""

    ref_nll: torch.Tensor
    mode_nll: torch.Tensor
    kl: torch.Tensor
    agree: torch.Tensor


def position_stats(ref: torch.Tensor, mode: torch.Tensor, window: Sequence[int]) -> PositionStats:
    """One window's per-position numbers from its two log-prob tensors (small: L floats each)."""
    target = torch.tensor(list(window[1:]))[:, None]
    p = ref.exp()
    # p * (log p - log q), 0 where p is 0 (a -inf log-prob would otherwise make 0 * inf = nan)
    kl = torch.where(p > 0, p * (ref - mode), 0.0).sum(dim=-1)
    return PositionStats(ref_nll=-ref.gather(1, target)[:, 0],
                         mode_nll=-mode.gather(1, target)[:, 0],
                         # float32 sums of a true KL near 0 can dip a hair below it
                         kl=kl.clamp_min(0.0), agree=ref.argmax(dim=-1) == mode.argmax(dim=-1))


@dataclass
class Scores:
    """A mode against the reference over all scored positions (KL in nats)."""

    perplexity: float
    ref_perplexity: float
    ppl_ratio: float
    mean_kl: float
    p99_kl: float
    top1_agree: float
    positions: int


def summarize(stats: Sequence[PositionStats]) -> Scores:
    """Scores over the positions of all windows' stats."""
    ref_nll = torch.cat([s.ref_nll for s in stats]).double()
    mode_nll = torch.cat([s.mode_nll for s in stats]).double()
    kl = torch.cat([s.kl for s in stats]).double()
    agree = torch.cat([s.agree for s in stats])
    ppl, ref_ppl = math.exp(mode_nll.mean().item()), math.exp(ref_nll.mean().item())
    return Scores(perplexity=ppl, ref_perplexity=ref_ppl, ppl_ratio=ppl / ref_ppl,
                  mean_kl=kl.mean().item(), p99_kl=torch.quantile(kl, 0.99).item(),
                  top1_agree=agree.double().mean().item(), positions=int(kl.numel()))


def compare(ref_logprobs: Sequence[torch.Tensor], mode_logprobs: Sequence[torch.Tensor],
            windows: Sequence[Sequence[int]]) -> Scores:
    """Scores of a mode's teacher-forced log-probs against the reference's, on `windows`."""
    return summarize([position_stats(r, m, w)
                      for r, m, w in zip(ref_logprobs, mode_logprobs, windows, strict=True)])


def auto_targets(scores: Scores) -> dict[str, bool]:
    """auto's targets against float32, each met or not."""
    return {f"top-1 >= {AUTO_MIN_TOP1:.1%}": scores.top1_agree >= AUTO_MIN_TOP1,
            f"mean KL <= {AUTO_MAX_MEAN_KL}": scores.mean_kl <= AUTO_MAX_MEAN_KL,
            f"ppl within {AUTO_MAX_PPL_DRIFT:.1%}": abs(scores.ppl_ratio - 1) <= AUTO_MAX_PPL_DRIFT}


def greedy_continuations(model: nn.Module, tokenizer: Any, prompts: Sequence[Sequence[int]],
                         tokens: int) -> list[list[int]]:
    """HF generate's greedy continuation of each prompt, one at a time, all `tokens` long."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            # eos_token_id=None: EOS does not stop generation, so every continuation is full
            # length (min_new_tokens would instead mask EOS and change the argmax)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=tokens, eos_token_id=None,
                                 pad_token_id=tokenizer.eos_token_id)
            cont = gen[0, ids.shape[1]:].tolist()
            if len(cont) != tokens:
                raise RuntimeError(f"generate stopped after {len(cont)} of {tokens} tokens")
            out.append(cont)
    return out

