"""A lean forward pass for Llama-shaped decoders: HF's weights and math, fewer calls per layer.

On a small model the arithmetic of a decode step is a few milliseconds; the rest of a step in
HF's module tree was Python and op dispatch (a profile of a one-token step: about half of its
time outside the linears). This forward keeps HF's modules for what is model-specific (token
embedding, rotary tables of any rope type, final norm, lm_head) and runs each decoder layer as
a flat sequence of calls:

    x += o(attend(rope(qkv(norm(x))))) ;  x += down(silu(gate) * up)  with gate|up = gate_up(norm(x))

- q, k and v are one linear (their weights stacked once at load); gate and up likewise: 4
  GEMMs per layer instead of 7, and the quantized / prepacked kernels then apply to the fused
  ones;
- rope is applied to q and k heads in one pass; RMSNorm uses torch's fused kernel in float32
  (bit-identical to HF's there) and HF's own module in other dtypes; where the linears run
  `--dtype auto`'s fixed-order kernel, the norms run a fixed-order one too (row_norm.py);
- the packed batch stays 2-D [tokens, hidden]: no batch dimension, no per-layer mask;
- where every linear of a layer runs the fixed-order kernel (`--dtype auto`), rope runs in place
  on the qkv output and SiLU-and-mul in one pass (row_ops.py), and the output projections add
  their result into the residual stream in place (`_forward_fused`): same math, ~10 fewer ops a
  layer, which on a one-token step is most of what is left outside the kernels.

Architectures whose layers carry more than this (q/k norms, sliding windows, logit soft-capping,
embedding multipliers) keep HF's forward with our attention plugged in (`supports`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mooncake_server.engine.attention import AttentionPlan, attend
from mooncake_server.engine.decode_calls import DecodeCalls
from mooncake_server.engine.linears import direct_call
from mooncake_server.engine.row_norm import row_norm_call, row_norm_fits
from mooncake_server.engine.row_ops import rope_, rope_fits, silu_mul, silu_mul_fits
from mooncake_server.engine.w8_linear import W8Linear

# model_type -> the layer shape this forward reproduces exactly
_SUPPORTED = {"llama", "mistral", "qwen2"}


def supports(model: nn.Module) -> bool:
    """The model's decoder layers are plain Llama-shaped (what `LlamaStack` reproduces)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in _SUPPORTED:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False  # a window would change which keys a token sees
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return False
    need = ("q_proj", "k_proj", "v_proj", "o_proj")
    return all(all(type(getattr(layer.self_attn, n, None)) is nn.Linear for n in need)
               and all(type(getattr(layer.mlp, n, None)) is nn.Linear
                       for n in ("gate_proj", "up_proj", "down_proj"))
               for layer in layers)


def _stack(linears: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the given linears' outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None,
                      dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([b.detach() for b in biases]),  # type: ignore[misc]
                                  requires_grad=False)
    return fused


class LlamaLayer(nn.Module):
    """One decoder layer's weights: fused qkv and gate|up, HF's norms and output projections."""

    def __init__(self, hf_layer: nn.Module, heads: int) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.layer_idx: int = attn.layer_idx
        self.scale: float = attn.scaling
        self.heads, self.head_dim = heads, attn.head_dim
        self.kv_heads = heads // attn.num_key_value_groups
        self.qkv = _stack([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.gate_up = _stack([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.input_norm = hf_layer.input_layernorm
        self.post_norm = hf_layer.post_attention_layernorm
        self.calls: _LayerCalls | None = None

    def bind(self) -> None:
        """Resolve what each of this layer's calls runs, once its kernels are final."""
        fixed = isinstance(self.qkv, W8Linear)
        # Fixed order all through: rope and SiLU-and-mul in one native pass each, and the
        # residual added by the output projections' kernel (one op and one tensor fewer each).
        fused = (fixed and isinstance(self.o_proj, W8Linear) and isinstance(self.down, W8Linear)
                 and rope_fits(self.head_dim) and silu_mul_fits(self.down.in_features))
        self.calls = _LayerCalls(
            norm_in=_norm_call(self.input_norm, fixed), qkv=direct_call(self.qkv),
            o_proj=direct_call(self.o_proj), norm_post=_norm_call(self.post_norm, fixed),
            gate_up=direct_call(self.gate_up), down=direct_call(self.down),
            o_add=self.o_proj.add_into if fused else None,  # type: ignore[operator]
            down_add=self.down.add_into if fused else None)  # type: ignore[operator]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """x [T, hidden] -> x after attention and MLP (residuals added)."""
        c = self.calls
        assert c is not None, "LlamaStack.bind() resolves the layers' calls"
        if c.o_add is not None:
            return self._forward_fused(x, cos, sin, plan)
        tokens, heads, head_dim = x.shape[0], self.heads, self.head_dim
        qkv = c.qkv(c.norm_in(x))
        rotated = heads + self.kv_heads
        qk = qkv[:, :rotated * head_dim].view(tokens, rotated, head_dim)
        half = head_dim // 2
        # HF's rotate_half(qk) * sin, with the sign already on the table (LlamaStack.forward)
        qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
        v = qkv[:, rotated * head_dim:].view(tokens, self.kv_heads, head_dim)
        out = attend(plan, self.layer_idx, qk[:, :heads], qk[:, heads:], v, self.scale)
        x = x + c.o_proj(out.view(tokens, -1))
        gate, up = c.gate_up(c.norm_post(x)).chunk(2, dim=-1)
        return x + c.down(F.silu(gate) * up)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       plan: AttentionPlan) -> torch.Tensor:
        """`forward` with native rope and SiLU-and-mul, the residual added in place by the
        output projections (x is updated and returned)."""
        c = self.calls
        assert c is not None and c.o_add is not None and c.down_add is not None
        tokens, heads, head_dim, kv_heads = x.shape[0], self.heads, self.head_dim, self.kv_heads
        qkv = c.qkv(c.norm_in(x))
        rope_(qkv, heads + kv_heads, cos, sin)
        q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
        out = attend(plan, self.layer_idx, qkv[:, :q_end].view(tokens, heads, head_dim),
                     qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim),
                     qkv[:, k_end:].view(tokens, kv_heads, head_dim), self.scale)
        c.o_add(out.view(tokens, -1), x)
        return c.down_add(silu_mul(c.gate_up(c.norm_post(x))), x)


@dataclass(frozen=True)
class _LayerCalls:
    """A layer's calls resolved to the functions they end in.

    nn.Module's call machinery and attribute lookup cost a few microseconds a call; a one-token
    step makes ~300 such calls, 1 ms of a 15 ms step here. Same functions, same results.
    """

    norm_in: Callable[[torch.Tensor], torch.Tensor]
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    norm_post: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    # residual += o_proj(h) / down(h) in place: set where the layer runs `_forward_fused`
    o_add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    down_add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def _norm_call(norm: nn.Module, fixed_order: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's RMSNorm `norm` as a function of x (x has the weight's dtype in this forward).

    Beside fixed-order linears, the fixed-order native norm (`fixed_order`); else in float32
    torch's fused kernel gives HF's bits in one call; other dtypes keep HF's module.
    """
    weight = norm.weight
    if fixed_order and row_norm_fits(weight):
        return row_norm_call(weight, norm.variance_epsilon)
    if weight.dtype == torch.float32:
        return functools.partial(F.rms_norm, normalized_shape=weight.shape, weight=weight,
                                 eps=norm.variance_epsilon)
    return norm.forward


class LlamaStack(nn.Module):
    """The whole causal LM as embed -> LlamaLayer x N -> norm -> lm_head over a packed batch."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        cfg = model.config
        self.config = cfg
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.layers = nn.ModuleList(LlamaLayer(layer, cfg.num_attention_heads)
                                    for layer in inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self._final_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.fixed_order = False  # every linear runs the fixed-order kernel (set by bind)
        self.decode_calls: DecodeCalls | None = None

    def bind(self) -> None:
        """Resolve every layer's calls; run once the linears' kernels are final (ModelRunner)."""
        for layer in self.layers:
            layer.bind()  # type: ignore[operator]
        self.fixed_order = isinstance(self.lm_head, W8Linear) and all(
            isinstance(layer.qkv, W8Linear) for layer in self.layers)
        self._final_norm = _norm_call(self.norm, self.fixed_order)
        calls = DecodeCalls(self) if self.fixed_order else None
        # pure decode passes as direct native calls (None: every pass runs the layers)
        self.decode_calls = calls if calls is not None and calls.usable else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_rows: torch.Tensor,
                plan: AttentionPlan) -> torch.Tensor:
        """Logits [len(last_rows), vocab] of the packed rows `last_rows`."""
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, positions[None])
        # [1, T, d] -> [T, 1, d]: broadcast over the q and k heads of each row.
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        # rotate_half(q) * sin = cat(-q2, q1) * sin = cat(q2, q1) * cat(-sin1, sin2): the sign
        # moves onto the table once per pass instead of onto q and k in every layer; a product's
        # rounding does not depend on its operands' signs, so the bits stay HF's.
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        assert self._final_norm is not None, "bind() resolves the calls (ModelRunner does)"
        calls = self.decode_calls
        if calls is not None and calls.fits(plan, x.shape[0]):
            x = calls.run(x, cos, sin, plan)
        else:
            for layer in self.layers:
                x = layer.forward(x, cos, sin, plan)
        return self.lm_head(self._final_norm(x.index_select(0, last_rows)))
