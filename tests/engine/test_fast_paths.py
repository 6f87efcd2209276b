"""The fast paths give HF's answers: the lean Llama stack, batched decode attention, bf16 packed
and int8 linears; models the lean stack does not cover keep HF's own forward."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from test_engine_loop import collect, hf_greedy, make_backend

from mooncake_server.engine.attention import causal_mask
from mooncake_server.engine.kv_cache import KVLayout, PagedKVCache, prompt_cut
from mooncake_server.engine.linears import apply_kernel, bf16_packing_supported, prepare_linears
from mooncake_server.engine.llama_stack import LlamaStack, supports
from mooncake_server.engine.model_runner import ModelRunner, StepItem, load_model, packed_forward
from mooncake_server.engine.sequence import Sequence
from mooncake_server.engine.vnni_linear import vnni_supported
from mooncake_server.engine.w8_linear import W8Linear, w8_supported
from mooncake_server.model_assets import resolve_model
from mooncake_server.wire.jobs import SamplingParams

GREEDY = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)


def _seq(kv: PagedKVCache, rid: str, tokens: list[int]) -> Sequence:
    seq = Sequence(rid, list(tokens), len(tokens), GREEDY, 512)
    seq.block_ids = kv.allocate(kv.layout.blocks_for(len(tokens) + 1))
    return seq


def _runner_greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from stepping one sequence by hand: its prompt, then n - 1 decodes."""
    kv = runner.kv
    seq = _seq(kv, "r", prompt)
    seq.block_ids += kv.allocate(kv.layout.blocks_for(len(prompt) + n) - len(seq.block_ids))
    out: list[int] = []
    logits = runner.step([StepItem(seq, len(prompt))])
    for _ in range(n):
        seq.num_computed = len(seq.token_ids)
        seq.token_ids.append(int(logits[0].argmax()))
        out.append(seq.token_ids[-1])
        logits = runner.step([StepItem(seq, 1)])
    kv.free(seq.block_ids)
    return out


def test_one_mixed_step_equals_each_sequence_alone(tiny_model_pair) -> None:
    """Decodes of unequal contexts (padding masked), a cached-context chunk and a fresh prompt."""
    _, paged = tiny_model_pair
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (5, 13, 30, 22, 9)]

    def run(batched: bool) -> list[torch.Tensor]:
        kv = PagedKVCache(layout, num_blocks=64)
        runner = ModelRunner(paged, kv)
        seqs = [_seq(kv, f"r{i}", p) for i, p in enumerate(prompts)]
        # Context for the first four: three decode next, the fourth continues its prompt.
        for s, done in zip(seqs[:4], (4, 12, 29, 10)):
            runner.step([StepItem(s, done)])
            s.num_computed = done
        items = [StepItem(seqs[0], 1), StepItem(seqs[3], 12), StepItem(seqs[1], 1),
                 StepItem(seqs[4], 9), StepItem(seqs[2], 1)]
        if batched:
            return list(runner.step(items))
        return [runner.step([it])[0] for it in items]

    for together, alone in zip(run(True), run(False)):
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_colocated_prompt_chunks_are_capped_while_sequences_decode(tiny_model_pair) -> None:
    """A long prompt arriving mid-decode joins steps at most --decode-chunk tokens at a time."""
    _, paged = tiny_model_pair
    backend, loop, _ = make_backend(paged, num_blocks=200, chunk=64)
    loop.decode_chunk_tokens = 8
    sizes: list[list[int]] = []
    step = loop.runner.step

    def spy(items, on_layer=None):  # noqa: ANN001, ANN202
        sizes.append([it.num_new for it in items])
        return step(items, on_layer)

    loop.runner.step = spy  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(4)
    short, long = (torch.randint(2, 250, (n,), generator=g).tolist() for n in (5, 60))

    async def scenario() -> tuple[list[int], list[int]]:
        loop.start()
        try:
            first = asyncio.create_task(collect(backend, "short", short, 20))
            while not any(s == [1] for s in sizes):
                await asyncio.sleep(0)  # the short one is decoding
            return await asyncio.gather(first, collect(backend, "long", long, 3))
        finally:
            await loop.stop()

    out_short, out_long = asyncio.run(scenario())
    mixed = [s for s in sizes if 1 in s and max(s) > 1]
    assert mixed and all(max(s) <= 8 for s in mixed)  # never a 60-token step beside a decode
    assert out_short == hf_greedy(tiny_model_pair[0], short, 20)
    assert out_long == hf_greedy(tiny_model_pair[0], long, 3)


def _greedy_with_linears(tiny_model_pair, dtype: torch.dtype, quantization: str) -> LlamaStack:
    ref, paged = (copy.deepcopy(m).to(dtype) for m in tiny_model_pair)
    # HF runs the same kernels: the reference differs from ours only in attention, batching and
    # the fused qkv / gate|up linears (quantized per output channel, so fusing changes nothing).
    prepare_linears(ref, dtype, quantization)
    paged = packed_forward(paged)
    assert isinstance(paged, LlamaStack)
    prepare_linears(paged, dtype, quantization)
    layout = KVLayout.from_model_config(paged.config, 4, dtype)
    kv = PagedKVCache(layout, num_blocks=200)
    runner = ModelRunner(paged, kv)
    g = torch.Generator().manual_seed(5)
    for n in (3, 18, 41):
        prompt = torch.randint(2, 250, (n,), generator=g).tolist()
        assert _runner_greedy(runner, prompt, 12) == hf_greedy(ref, prompt, 12)
    return paged


@pytest.mark.skipif(not bf16_packing_supported(), reason="this CPU/torch has no oneDNN bf16")
def test_bf16_packed_linears_greedy_equals_hf_in_bf16(tiny_model_pair) -> None:
    """--dtype bfloat16 with prepacked linears matches HF running bf16."""
    _greedy_with_linears(tiny_model_pair, torch.bfloat16, "none")


def test_int8_linears_greedy_equals_hf_with_the_same_quantization(tiny_model_pair) -> None:
    """--quantization int8 matches HF quantized alike."""
    _greedy_with_linears(tiny_model_pair, torch.float32, "int8")


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
def test_auto_kernel_greedy_equals_hf_with_the_same_kernel(tiny_model_pair) -> None:
    """--dtype auto: the weight-only int8 kernel in every linear, prompts and steps alike."""
    _greedy_with_linears(tiny_model_pair, torch.float32, "auto")


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
def test_auto_on_a_q4_1_models_weights_runs_four_bits_and_matches_hf(tiny_q4_model_pair) -> None:
    """The bundled model's case: every linear on a 4-bit grid runs from nibbles."""
    paged = _greedy_with_linears(tiny_q4_model_pair, torch.float32, "auto")
    bits = {m.bits for m in paged.modules() if isinstance(m, W8Linear)}
    assert bits == {4}


@pytest.mark.skipif(not vnni_supported(), reason="this CPU has no AVX512-VNNI")
def test_vnni_kernel_greedy_equals_hf_with_the_same_kernel(tiny_model_pair) -> None:
    """The VNNI int8 GEMV (a mode bench_quality scores) in every linear but the output's."""
    ref, paged = (copy.deepcopy(m) for m in tiny_model_pair)
    apply_kernel(ref, "int8-vnni")
    paged = packed_forward(paged)
    apply_kernel(paged, "int8-vnni")
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    runner = ModelRunner(paged, PagedKVCache(layout, num_blocks=200))
    prompt = torch.randint(2, 250, (18,), generator=torch.Generator().manual_seed(5)).tolist()
    assert _runner_greedy(runner, prompt, 12) == hf_greedy(ref, prompt, 12)


def _logits_alone_and_batched(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list, list]:
    """Each prompt's prefill and 3 decode steps' logits: run alone, then all in one batch."""
    kv = runner.kv

    def run(group: list[list[int]]) -> list[list[torch.Tensor]]:
        seqs = [_seq(kv, f"r{i}", p) for i, p in enumerate(group)]
        for seq in seqs:
            seq.block_ids += kv.allocate(kv.layout.blocks_for(len(seq.token_ids) + 4)
                                         - len(seq.block_ids))
        out: list[list[torch.Tensor]] = [[] for _ in seqs]
        logits = runner.step([StepItem(s, len(s.token_ids)) for s in seqs])
        for _ in range(3):
            for i, seq in enumerate(seqs):
                out[i].append(logits[i].clone())
                seq.num_computed = len(seq.token_ids)
                seq.token_ids.append(int(logits[i].argmax()))
            logits = runner.step([StepItem(s, 1) for s in seqs])
        for seq in seqs:
            kv.free(seq.block_ids)
        return out

    alone = [run([p])[0] for p in prompts]
    return alone, run(prompts)


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
@pytest.mark.parametrize("pair", ["tiny_model_pair", "tiny_q4_model_pair"])
def test_auto_logits_do_not_depend_on_what_shares_the_step(pair: str, request) -> None:
    """A request's greedy answer in the default mode is the same alone or in any batch: every
    row of auto's linears is summed in one fixed order (float32's BLAS is not: docs/engine.md),
    from bytes or from 4-bit weights."""
    paged = packed_forward(copy.deepcopy(request.getfixturevalue(pair)[1]))
    prepare_linears(paged, torch.float32, "auto")
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    runner = ModelRunner(paged, PagedKVCache(layout, num_blocks=200))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (5, 17, 30, 9, 41)]
    alone, batched = _logits_alone_and_batched(runner, prompts)
    for a, b in zip(alone, batched):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _block_bytes(kv: PagedKVCache, block_ids: list[int]) -> list[bytes]:
    return [kv.pool[b].numpy().tobytes() for b in block_ids]


def _kv_in_passes(runner: ModelRunner, prompts: list[list[int]], chunk: int) -> list[list[bytes]]:
    """Each prompt's full KV blocks, the prompts computed together in passes of `chunk` tokens
    cut as the prefill and colocated schedulers cut them (`prompt_cut`)."""
    kv = runner.kv
    bt = kv.layout.block_tokens
    seqs = [_seq(kv, f"r{i}", p) for i, p in enumerate(prompts)]
    while any(s.num_pending for s in seqs):
        items, left = [], chunk
        for s in seqs:
            n = prompt_cut(s.num_computed, s.num_pending, left, bt, first=left == chunk)
            if s.num_pending and n:
                items.append(StepItem(s, n))
                left -= n
        runner.step(items)
        for it in items:
            it.seq.num_computed += it.num_new
    out = [_block_bytes(kv, s.block_ids[:len(s.token_ids) // bt]) for s in seqs]
    for s in seqs:
        kv.free(s.block_ids)
    return out


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
def test_a_shared_prefix_gets_the_same_kv_bits_however_passes_cut_it() -> None:
    """The default model in the default mode: two chat requests sharing a 40-token prefix,
    computed together in passes that cut them at different places, write the prefix's blocks
    bit for bit as one request alone in one pass does. The store keeps one copy per key, and
    each decode checks the copy against its own prefill's checksums."""
    model = load_model(resolve_model(None), torch.float32, "auto")
    layout = KVLayout.from_model_config(model.config, 16, torch.float32)
    runner = ModelRunner(model, PagedKVCache(layout, num_blocks=64))
    g = torch.Generator().manual_seed(12)
    prefix = torch.randint(2, 40_000, (40,), generator=g).tolist()
    a, b = (prefix + torch.randint(2, 40_000, (n,), generator=g).tolist() for n in (7, 13))
    alone = _kv_in_passes(runner, [b], chunk=64)[0]
    for chunk in (10, 13, 22, 50):  # budgets that end inside a block (cut there, bits differed)
        together = _kv_in_passes(runner, [a, b], chunk)
        assert together[0][:2] == together[1][:2] == alone[:2], chunk
        assert together[1] == alone, chunk


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("head_dim", [16, 12])
def test_each_lean_architecture_in_auto_greedy_equals_hf_with_the_same_kernel(
        arch: str, head_dim: int) -> None:
    """Models other than the default keep working in the default mode: each architecture the
    lean stack covers (qwen2's qkv biases included), with heads the native decode takes (16)
    and heads it leaves to the gathered path (12), greedy-equal to HF on the same kernel."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mooncake_server.engine.attention import register_paged_attention
    from mooncake_testkit.quality import q4_1

    heads = 4
    cfg = AutoConfig.for_model(arch, vocab_size=256, hidden_size=heads * head_dim * 2,
                               intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=heads * 2, num_key_value_heads=2,
                               max_position_embeddings=512, sliding_window=None,
                               bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(4)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(q4_1(module.weight))
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                             attn_implementation=register_paged_attention())
    paged.load_state_dict(ref.state_dict())
    stack = _greedy_with_linears((ref, paged.eval()), torch.float32, "auto")
    runner = ModelRunner(stack, PagedKVCache(KVLayout.from_model_config(stack.config, 4,
                                                                        torch.float32), num_blocks=50))
    assert runner.native_decode == (head_dim % 8 == 0)


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
def test_auto_attends_decoding_rows_natively_and_agrees_with_the_gathered_path(
        tiny_q4_model_pair) -> None:
    """The default mode's decode attention reads the pool's blocks in one native call per layer
    (each row's own tokens, no padding); its logits stay within float32 rounding of the torch
    path's (gather + matmuls), at contexts across several blocks and a 256-token bucket."""
    paged = packed_forward(copy.deepcopy(tiny_q4_model_pair[1]))
    prepare_linears(paged, torch.float32, "auto")
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    native = ModelRunner(paged, PagedKVCache(layout, num_blocks=300))
    gathered = ModelRunner(paged, PagedKVCache(layout, num_blocks=300))
    gathered.native_decode = False
    assert native.native_decode
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (3, 70, 261)]
    a, b = _logits_alone_and_batched(native, prompts), _logits_alone_and_batched(gathered, prompts)
    for mine, theirs in zip(a[1], b[1]):
        for x, y in zip(mine, theirs):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
            assert int(x.argmax()) == int(y.argmax())


@pytest.mark.skipif(not w8_supported(), reason="this CPU has no AVX2+FMA")
def test_direct_decode_calls_give_the_layers_bits(tiny_q4_model_pair) -> None:
    """A pure decode pass runs as direct native calls (decode_calls.py) with the very bits of
    the layer-by-layer forward, alone and batched; each layer's K/V hook still fires in order."""
    paged = packed_forward(copy.deepcopy(tiny_q4_model_pair[1]))
    prepare_linears(paged, torch.float32, "auto")
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    runner = ModelRunner(paged, PagedKVCache(layout, num_blocks=300))
    calls = runner.model.decode_calls
    assert calls is not None
    used: list[int] = []
    run = calls.run
    calls.run = lambda *a: used.append(1) or run(*a)  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (3, 70, 20)]
    direct = _logits_alone_and_batched(runner, prompts)
    assert len(used) == 3 * 4  # every decode step of the 3 alone and the batch
    runner.model.decode_calls = None
    layered = _logits_alone_and_batched(runner, prompts)
    for mine, theirs in zip(direct[0] + direct[1], layered[0] + layered[1]):
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs))
    runner.model.decode_calls = calls
    seq = _seq(runner.kv, "hook", prompts[0])
    seq.block_ids += runner.kv.allocate(2)
    runner.step([StepItem(seq, len(prompts[0]))])
    seq.num_computed = len(prompts[0])
    seq.token_ids.append(7)
    seen: list[int] = []
    runner.step([StepItem(seq, 1)], on_layer=seen.append)
    assert seen == list(range(paged.config.num_hidden_layers)) and len(used) == 13


def test_packed_bf16_linear_is_bit_identical_to_plain_bf16(tiny_model_pair) -> None:
    """Prepacking changes the weight's layout, never a result."""
    if not bf16_packing_supported():
        pytest.skip("this CPU/torch has no oneDNN bf16")
    lin = torch.nn.Linear(64, 96).to(torch.bfloat16)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    expected = lin(x)
    holder = torch.nn.Sequential(lin)
    prepare_linears(holder, torch.bfloat16, "none")
    assert torch.equal(holder(x), expected)


def test_lean_stack_logits_equal_hf_forward_in_float32(tiny_model_pair) -> None:
    """Fused qkv / gate|up, one-pass rope and fused RMSNorm compute HF's logits."""
    ref, paged = tiny_model_pair
    layout = KVLayout.from_model_config(paged.config, 4, torch.float32)
    kv = PagedKVCache(layout, num_blocks=64)
    runner = ModelRunner(paged, kv)
    assert isinstance(runner.model, LlamaStack)
    prompt = torch.randint(2, 250, (23,), generator=torch.Generator().manual_seed(6)).tolist()
    seq = _seq(kv, "r", prompt)
    ours = runner.step([StepItem(seq, len(prompt))])[0]
    with torch.inference_mode():
        theirs = ref(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_models_the_lean_stack_does_not_cover_run_hf_modules() -> None:
    """A Qwen3-style model (q/k norms in attention) decodes through HF's forward, exactly."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from mooncake_server.engine.attention import register_paged_attention

    torch.manual_seed(7)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512, eos_token_id=None)
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                             attn_implementation=register_paged_attention())
    paged.load_state_dict(ref.state_dict())
    assert not supports(paged)
    kv = PagedKVCache(KVLayout.from_model_config(cfg, 4, torch.float32), num_blocks=64)
    runner = ModelRunner(paged.eval(), kv)
    assert not isinstance(runner.model, LlamaStack)
    prompt = torch.randint(2, 250, (11,), generator=torch.Generator().manual_seed(8)).tolist()
    assert _runner_greedy(runner, prompt, 6) == hf_greedy(ref, prompt, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_over_cached_context_gets_an_additive_mask_in_its_dtype(dtype: torch.dtype
                                                                        ) -> None:
    """SDPA converts a bool mask into this one on every call (a fresh [q, ctx] buffer per
    layer); built once per pass in the activations' dtype, it is used as it is."""
    mask = causal_mask(3, 5, 8, dtype)  # queries at positions 2, 3, 4; 8 padded key slots
    assert mask.dtype == dtype and mask.shape == (3, 8)
    sees = torch.arange(8)[None, :] <= torch.tensor([2, 3, 4])[:, None]
    assert torch.equal(torch.isneginf(mask), ~sees)
    assert torch.equal(mask[sees], torch.zeros(int(sees.sum()), dtype=dtype))
