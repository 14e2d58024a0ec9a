"""The decoder's layers in one compiled call (``worker_svc/cpu_decoder.py``) give the bits of
the same layers run one by one, and step aside where a piece of a layer is not compiled or
a hook waits on it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_attention import threads

from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler
from worker_svc.checkpoint import build_model
from worker_svc.cpu_attention import attention_kernel
from worker_svc.cpu_decoder import decoder_library
from worker_svc.cpu_linear import pack_linears, panel_gemm
from worker_svc.cpu_ops import cpu_ops
from worker_svc.model import Transformer
from worker_svc.model_config import PRESETS, ModelConfig
from worker_svc.runner import StepRunner

CPU = torch.device("cpu")
BLOCK = 16
pytestmark = pytest.mark.skipif(
    panel_gemm() is None or cpu_ops() is None or decoder_library() is None
    or attention_kernel(1, 1, 16, BLOCK) is None,
    reason="no C compiler or libgomp: the layers run one by one")

CONFIGS = {
    "llama": PRESETS["tiny"],
    "m-rope": PRESETS["tiny-mrope"],
    # Qwen2's biases on q/k/v; the others' on o and the MLP, to reach each bias pass
    "biases": dataclasses.replace(PRESETS["tiny"], qkv_bias=True, out_bias=True, mlp_bias=True),
}


def served(config: ModelConfig) -> Transformer:
    """As the worker serves it: panels, then the caches (which set up the decoder)."""
    model = build_model(config, CPU, torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # init_weights zeroes them: make them count
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    assert pack_linears(model, panels=True) > 0
    model.setup_caches(num_blocks=96, block_size=BLOCK)
    return model


def greedy_run(model: Transformer) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Four requests of different lengths, chunked differently, so that steps mix prefill
    chunks (several per step) with decodes: (each one's tokens, every step's logits)."""
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        runner, sched = StepRunner(model, receiver=None), ScriptedScheduler(BLOCK)
        reqs = [ScriptedRequest(f"r{i}", list(range(3 + i, 30 + 17 * i)), [], max_new_tokens=6,
                                chunk_size=9 + 7 * i) for i in range(4)]
        sched.run(runner.step, reqs)
        runner.step(sched.flush())
    finally:
        hook.remove()
    return [r.output for r in reqs], captured


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_layers_in_one_call_give_the_bits_of_the_layers_one_by_one(
        name: str, num_threads: int) -> None:
    model = served(CONFIGS[name])
    decoder = model.decoder
    assert decoder is not None and decoder.applies(model.layers)
    with threads(num_threads):
        tokens, logits = greedy_run(model)
        model.decoder = None  # the same model, layer by layer
        one_by_one, want = greedy_run(model)
    assert tokens == one_by_one and all(len(t) == 6 for t in tokens)
    assert len(logits) == len(want) > 4
    for got, expected in zip(logits, want, strict=True):
        assert torch.equal(got, expected)


def test_a_hook_or_a_piece_switched_off_sends_the_step_layer_by_layer() -> None:
    """A forward hook (tensor parallelism's all-reduce) must see its module run; a kernel
    switched off after setup must not be bypassed."""
    model = served(CONFIGS["llama"])
    decoder = model.decoder
    assert decoder is not None
    seen: list[tuple[int, ...]] = []
    hook = model.layers[1].attention.wo.register_forward_hook(
        lambda _m, _i, out: seen.append(tuple(out.shape)))
    assert not decoder.applies(model.layers)
    tokens, _ = greedy_run(model)
    assert seen and all(len(t) == 6 for t in tokens)
    hook.remove()
    assert decoder.applies(model.layers)
    model.layers[2].attention.kernel = None
    assert not decoder.applies(model.layers)
    assert greedy_run(model)[0] == tokens


def test_where_a_piece_is_not_compiled_there_is_no_decoder() -> None:
    unpacked = build_model(CONFIGS["llama"], CPU, torch.float32)  # F.linear's weights
    unpacked.setup_caches(num_blocks=16, block_size=BLOCK)
    assert unpacked.decoder is None
    # the MLP's 2 x 200 columns: the GEMM's output padded to a multiple of its tile width
    padded = served(dataclasses.replace(PRESETS["tiny"], intermediate_size=200))
    assert padded.decoder is None
    assert padded.layers[0].attention.kernel is not None  # the rest still compiled


def test_a_slot_out_of_range_is_refused_and_not_written() -> None:
    model = served(CONFIGS["llama"])
    assert model.decoder is not None and model.decoder.applies(model.layers)
    runner, sched = StepRunner(model, receiver=None), ScriptedScheduler(BLOCK)
    captured = []
    hook = model.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))
    try:
        sched.run(runner.step, [ScriptedRequest("r", list(range(3, 40)), [], max_new_tokens=2)])
    finally:
        hook.remove()
    inputs = captured[0]
    slots = inputs.slot_mapping.clone()
    slots[3] = model.num_blocks * BLOCK  # one past the last slot
    caches = [(a.kv_cache.k_cache.clone(), a.kv_cache.v_cache.clone())
              for a in (b.attention for b in model.layers)]
    with torch.inference_mode(), pytest.raises(IndexError, match="1 of 37 cache slots"):
        model(dataclasses.replace(inputs, slot_mapping=slots))
    for b, (k, v) in zip(model.layers, caches, strict=True):
        # the rows of valid slots were rewritten with the same values; none past the end
        assert torch.equal(b.attention.kv_cache.k_cache, k)
        assert torch.equal(b.attention.kv_cache.v_cache, v)
    wrong = dataclasses.replace(inputs, slot_mapping=inputs.slot_mapping.int())
    with torch.inference_mode(), pytest.raises(ValueError, match="CPU decoder called with"):
        model(wrong)
