"""Runs a HuggingFace causal LM over the paged KV cache, one packed forward pass at a time."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from mooncake_server.engine.attention import (
    AttentionPlan,
    DecodeBatch,
    DecodeGroup,
    NativeDecode,
    PromptSlice,
    causal_mask,
    decode_width,
    native_decode_supported,
    per_layer,
    register_paged_attention,
)
from mooncake_server.engine.core_budget import CoreBudget, FixedThreads
from mooncake_server.engine.cpu import CpuFeatures, resolve_dtype_name
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache
from mooncake_server.engine.linears import prepare_linears
from mooncake_server.engine.llama_stack import LlamaStack, supports
from mooncake_server.engine.sequence import Sequence
from mooncake_server.wire.jobs import SamplingParams

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """Map --dtype to the activations' torch dtype ('auto': float32, measured linears)."""
    return _DTYPES[resolve_dtype_name(name)]


def packed_forward(model: torch.nn.Module) -> torch.nn.Module:
    """The forward a runner drives: the lean `LlamaStack` where the model allows, else HF's."""
    if isinstance(model, LlamaStack) or not supports(model):
        return model
    return LlamaStack(model).eval()


def load_model(model_path: str, dtype: torch.dtype, quantization: str = "none",
               cpu: CpuFeatures | None = None) -> torch.nn.Module:
    """Load HF weights with our paged attention and the CPU's kernels; inference mode, eval.

    `quantization` "auto" runs the kernel kernel_choice.py picks for `cpu` (default: this
    machine's flags): the same on every start and in every role.
    """
    impl = register_paged_attention()
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=impl)
    # Fuse before quantizing or packing: the kernels then apply to the fused linears.
    model = packed_forward(hf.eval())
    done = prepare_linears(model, dtype, quantization, cpu)
    log.info("forward: %s; linears: %s",
             "lean Llama stack" if isinstance(model, LlamaStack) else "HF modules", done)
    return model


@dataclass(frozen=True)
class StepItem:
    """Compute `num_new` pending tokens of `seq` in this forward pass."""

    seq: Sequence
    num_new: int


class ModelRunner:
    """Owns the model and the KV pool; `step` is blocking and must run off the event loop."""

    def __init__(self, model: torch.nn.Module, kv: PagedKVCache,
                 cores: CoreBudget | FixedThreads | None = None) -> None:
        self.model = packed_forward(model)
        if isinstance(self.model, LlamaStack):
            self.model.bind()  # the kernels are final now
        self.kv = kv
        self.layout: KVLayout = kv.layout
        # `--dtype auto`'s forward attends its decoding rows natively in one fixed order.
        self.native_decode = (isinstance(self.model, LlamaStack) and self.model.fixed_order
                              and native_decode_supported(kv.layout))
        self.cores = cores or FixedThreads(None)
        # The last pass's wait for its turn on the cores and its own time after it: a token gap
        # is one plus the other, and only the second scales with the batch.
        self.last_wait_s = 0.0
        self.last_compute_s = 0.0
        self._turn: tuple[float, float] | None = None  # (asked, got) of a turn taken ahead

    @property
    def takes_turns(self) -> bool:
        """Whether passes wait for a turn on cores shared with other engine processes."""
        return isinstance(self.cores, CoreBudget)

    def take_turn(self) -> None:
        """Wait for the turn on the cores now (blocking, on the forward thread); the next
        `step` runs in it, or `give_turn` hands it on unused."""
        if self._turn is not None:
            return
        asked = time.perf_counter()
        self.cores.enter_step()
        self._turn = (asked, time.perf_counter())

    def give_turn(self) -> None:
        """Hand on a turn `take_turn` took that no pass used (a no-op without one)."""
        if self._turn is not None:
            self._turn = None
            self.cores.exit_step()

    def quiet_step_s(self, passes: int = 5) -> float:
        """The fastest of `passes` one-token passes of a scratch sequence (a decode step at
        batch 1 and a context of a few tokens), blocking; its blocks are freed after."""
        return self._scratch_passes_s(1, passes)

    def prompt_pass_s(self, tokens: int, passes: int = 2) -> float:
        """The fastest of `passes` passes of a `tokens`-token scratch prompt with no cached
        context, blocking; its blocks are freed after."""
        return self._scratch_passes_s(tokens, passes, again=True)

    def _scratch_passes_s(self, tokens: int, passes: int, again: bool = False) -> float:
        """The fastest compute time of `passes` passes of `tokens` new tokens each: one after
        the other in one scratch sequence, or (`again`) the same tokens each time."""
        total = tokens if again else tokens * passes
        seq = Sequence("scratch-pass", [0] * total, total, SamplingParams(max_tokens=1), total)
        seq.block_ids = self.kv.allocate(self.layout.blocks_for(total))
        best = math.inf
        try:
            for _ in range(passes):
                self.step([StepItem(seq, tokens)])
                if not again:
                    seq.num_computed += tokens
                best = min(best, self.last_compute_s)
        finally:
            self.kv.free(seq.block_ids)
            seq.block_ids = []
        return best

    @torch.inference_mode()
    def step(self, items: Seq[StepItem],
             on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One packed forward pass; returns float32 logits [len(items), vocab] of each item's last token.

        Then, for items whose sequence scores its prompt (echo), every row of their chunk.

        Every item's `seq.block_ids` must already cover `num_computed + num_new` tokens.
        `on_layer(l)` is called as soon as layer l's new K/V are written to the pool.
        The pass runs in the turn `take_turn` took, or waits for one.
        """
        self.take_turn()
        assert self._turn is not None
        (asked, began), self._turn = self._turn, None
        try:
            return self._forward(items, on_layer)
        finally:
            self.cores.exit_step()
            self.last_wait_s, self.last_compute_s = began - asked, time.perf_counter() - began
            self.cores.note_step(self.last_compute_s)

    def _forward(self, items: Seq[StepItem],
                 on_layer: Callable[[int], None] | None) -> torch.Tensor:
        """The pass itself, on the lean stack or HF's forward (the turn on the cores held)."""
        plan, input_ids, positions, last_rows = self._plan(items, on_layer)
        # Prompt scoring (echo): every row of a scoring item's chunk, after the last rows.
        last_rows += [r for it, last in zip(items, last_rows[:len(items)]) if it.seq.scores_prompt
                      for r in range(last - it.num_new + 1, last + 1)]
        ids = torch.tensor(input_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.tensor(last_rows, dtype=torch.long)
        if isinstance(self.model, LlamaStack):
            return self.model(ids, pos, rows, plan).float()
        out = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                         logits_to_keep=rows, paged_ctx=plan)
        return out.logits[0].float()

    def _decode_group(self, tables: list[list[int]], lens: list[int], start: int, width: int,
                      runs_per_block: int, head_runs: torch.Tensor, layers: int) -> DecodeGroup:
        """Decoding rows from `start` with block `tables`, context lengths `lens`, padded to
        `width` blocks (a short table repeats its first block, masked out)."""
        bt = self.layout.block_tokens
        kvh = self.layout.kv_heads
        padded = [t + [t[0]] * (width - len(t)) for t in tables]
        blocks = torch.tensor(padded, dtype=torch.long).view(1, len(tables), 1, width)
        bias = None
        if any(n != width * bt for n in lens):
            pad = torch.arange(width * bt)[None, :] >= torch.tensor(lens)[:, None]
            bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))
            bias = bias.view(len(lens), 1, 1, width * bt)
        runs = per_layer((blocks * runs_per_block + head_runs).view(-1), layers, 2 * kvh)
        return DecodeGroup(start, len(tables), runs, bias)

    @staticmethod
    def _native_decode(tables: list[list[int]], lens: list[int], layers: int) -> NativeDecode:
        """The decoding rows' block tables for the native kernel (short ones padded with a
        valid block it never reads)."""
        width = max(len(t) for t in tables)
        padded = [t + [t[0]] * (width - len(t)) for t in tables]
        return NativeDecode(torch.tensor(padded, dtype=torch.long),
                            torch.tensor(lens, dtype=torch.int32), layers)

    def _plan(self, items: Seq[StepItem], on_layer: Callable[[int], None] | None,
              ) -> tuple[AttentionPlan, list[int], list[int], list[int]]:
        """Pack the batch (decoding sequences first, then prompt chunks) and index its KV."""
        bt = self.layout.block_tokens
        kvh = self.layout.kv_heads
        layers = self.layout.num_layers
        runs_per_block = layers * 2 * kvh  # `head_runs` rows per block
        block_rows = runs_per_block * bt  # `head_rows` rows per block
        # Offsets within layer 0 of a block: head h's slot (K) and run (K, then V).
        head_slots = torch.arange(kvh) * bt
        head_runs = torch.arange(2 * kvh).view(2, 1, kvh, 1)
        for it in items:
            end = it.seq.num_computed + it.num_new
            if len(it.seq.block_ids) * bt < end:
                raise RuntimeError(
                    f"{it.seq.request_id}: blocks cover {len(it.seq.block_ids) * bt} < {end}")
        # One new token over cached context decodes; anything else is a prompt (chunk).
        decoding = [it.num_new == 1 and it.seq.num_computed > 0 for it in items]
        decodes = [i for i, d in enumerate(decoding) if d]
        prompts = [i for i, d in enumerate(decoding) if not d]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # decode rows: pool row of the new token (head 0)
        last_rows = [0] * len(items)
        decode: DecodeBatch | None = None
        if decodes:
            # Rows in order of padded width, so each width's group is one slice of rows.
            decodes.sort(key=lambda i: decode_width(items[i].seq.num_computed // bt + 1, bt))
            tables: list[list[int]] = []
            lens: list[int] = []
            for row, i in enumerate(decodes):
                s = items[i].seq
                pos = s.num_computed
                input_ids.append(s.token_ids[pos])
                positions.append(pos)
                slots.append(s.block_ids[pos // bt] * block_rows + pos % bt)
                tables.append(s.block_ids[:pos // bt + 1])
                lens.append(pos + 1)
                last_rows[i] = row
            if self.native_decode:
                decode = DecodeBatch(size=len(decodes), groups=[],
                                     native=self._native_decode(tables, lens, layers))
            else:
                groups: list[DecodeGroup] = []
                start = 0
                while start < len(tables):
                    width = decode_width(len(tables[start]), bt)
                    end = start
                    while end < len(tables) and decode_width(len(tables[end]), bt) == width:
                        end += 1
                    groups.append(self._decode_group(tables[start:end], lens[start:end], start,
                                                     width, runs_per_block, head_runs, layers))
                    start = end
                decode = DecodeBatch(size=len(decodes), groups=groups)
        slot_parts = [torch.tensor(slots, dtype=torch.long)] if slots else []
        prompt_slices: list[PromptSlice] = []
        for i in prompts:
            s, n = items[i].seq, items[i].num_new
            start, end = s.num_computed, s.num_computed + n
            table = torch.tensor(s.block_ids[:-(-end // bt)], dtype=torch.long)
            pos = torch.arange(start, end)
            slot_parts.append(table[pos // bt] * block_rows + pos % bt)
            q_start = len(input_ids)
            if start == 0:
                prompt_slices.append(PromptSlice(q_start, n))
            else:
                runs = (table.view(1, 1, 1, -1) * runs_per_block + head_runs).view(-1)
                prompt_slices.append(PromptSlice(q_start, n,
                                                 ctx_runs=per_layer(runs, layers, 2 * kvh),
                                                 mask=causal_mask(n, end, len(table) * bt,
                                                                   self.layout.dtype)))
            input_ids.extend(s.token_ids[start:end])
            positions.extend(range(start, end))
            last_rows[i] = len(input_ids) - 1
        token_slots = torch.cat(slot_parts)
        plan = AttentionPlan(head_rows=self.kv.head_rows, head_runs=self.kv.head_runs,
                             block_tokens=bt, kv_heads=kvh,
                             slot_rows=per_layer((token_slots[:, None] + head_slots).view(1, -1),
                                                 2 * layers, kvh * bt).view(layers, 2, -1),
                             decode=decode,
                             prompts=prompt_slices, on_layer=on_layer)
        return plan, input_ids, positions, last_rows
