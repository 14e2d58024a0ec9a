"""The compiled elementwise ops (worker_svc/cpu_ops.py) against the torch ops they replace,
and the decoder with them against the decoder without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler
from worker_svc.checkpoint import build_model
from worker_svc.cpu_ops import CpuOps, cpu_ops
from worker_svc.layers import (
    RMSNorm,
    apply_rotary,
    pair_components,
    rotary_for_positions,
    rotary_table,
)
from worker_svc.model import PagedKVCache, Transformer
from worker_svc.model_config import PRESETS
from worker_svc.runner import StepRunner

pytestmark = pytest.mark.skipif(cpu_ops() is None,
                                reason="no C compiler or libgomp: the model keeps torch's ops")
CPU = torch.device("cpu")
ROWS = [1, 3, 16, 150, 513]  # one, odd, a decode batch, a prefill chunk, above the threading cut


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data.copy_(weight)
    return norm(x)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [576, 80, 7])  # SmolLM2's, a no-multiple of 16, a tiny one
def test_rms_norm_and_its_residual_add(rows: int, dim: int) -> None:
    ops = cpu_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows * 100 + dim)
    x, residual = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), torch_norm(x, weight, 1e-6))

    summed = x.clone()
    normed = ops.rms_norm(summed, weight, 1e-6, residual)
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0)  # the sum, in place
    torch.testing.assert_close(normed, torch_norm(x + residual, weight, 1e-6))


@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_of_the_fused_gate_and_up(rows: int) -> None:
    ops = cpu_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([-200.0, -89.0, 0.0, 200.0])  # far tails stay finite
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n_heads", "n_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16)])
def test_rotation_and_cache_write_match_torch(rows: int, n_heads: int, n_kv_heads: int,
                                              head_dim: int) -> None:
    ops = cpu_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows + head_dim)
    blocks, block_size = 64, 16
    qkv = torch.randn(rows, (n_heads + 2 * n_kv_heads) * head_dim, generator=gen)
    table = rotary_table(head_dim // 2, 2048, 10000.0, CPU)
    positions = torch.randint(0, 2048, (3, rows), generator=gen)
    sections = (head_dim // 4, head_dim // 8, head_dim // 2 - head_dim // 4 - head_dim // 8)
    rot = rotary_for_positions(table, positions, pair_components(sections, CPU))  # M-RoPE
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    cache = PagedKVCache(blocks, block_size, n_kv_heads, head_dim, torch.float32,
                         keys_by_dim=True)
    k_cache, v_cache = cache.k_cache, cache.v_cache

    q = ops.rotate_into_cache(qkv, rot, slots, k_cache, v_cache, n_heads)

    q_ref, k_ref, v_ref = qkv.split([n_heads * head_dim, n_kv_heads * head_dim,
                                     n_kv_heads * head_dim], dim=-1)
    torch.testing.assert_close(q, apply_rotary(q_ref.view(rows, n_heads, head_dim), rot))
    flat_k = cache.keys().reshape(-1, n_kv_heads, head_dim)  # (slots, Hkv, D)
    flat_v = v_cache.view(-1, n_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], apply_rotary(
        k_ref.reshape(rows, n_kv_heads, head_dim), rot))
    torch.testing.assert_close(flat_v[slots], v_ref.reshape(rows, n_kv_heads, head_dim),
                               rtol=0, atol=0)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_a_slot_out_of_range_is_refused_and_writes_nothing_there() -> None:
    ops = cpu_ops()
    assert ops is not None
    cache = PagedKVCache(4, 16, 1, 16, torch.float32, keys_by_dim=True)
    rot = torch.polar(torch.ones(2, 8), torch.zeros(2, 8))
    with pytest.raises(IndexError, match="1 of 2 cache slots out of range"):
        ops.rotate_into_cache(torch.ones(2, 48), rot, torch.tensor([3, 64]), cache.k_cache,
                              cache.v_cache, 1)
    assert cache.keys().reshape(-1, 16)[3].eq(1).all() and cache.k_cache.sum() == 16
    assert cache.v_cache.view(-1, 16)[3].eq(1).all() and cache.v_cache.sum() == 16


def test_a_layout_the_c_code_cannot_read_is_refused() -> None:
    ops = cpu_ops()
    assert ops is not None
    with pytest.raises(ValueError, match="rms_norm called with"):
        ops.rms_norm(torch.ones(4, 8).t(), torch.ones(4), 1e-6)  # not contiguous
    with pytest.raises(ValueError, match="rms_norm called with"):
        ops.rms_norm(torch.ones(4, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="silu_mul called with"):
        ops.silu_mul(torch.ones(4, 7))
    with pytest.raises(ValueError, match="rotate_into_cache called with"):
        ops.rotate_into_cache(torch.ones(2, 48), torch.ones(2, 8, dtype=torch.complex64),
                              torch.tensor([0, 1]), torch.zeros(4, 16, 1, 16),  # keys by slot
                              torch.zeros(4, 16, 1, 16), 1)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    ops = cpu_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(7)
    x, weight = torch.randn(200, 576, generator=gen), torch.randn(576, generator=gen)
    gate_up = torch.randn(200, 3072, generator=gen)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5)[5], ops.rms_norm(x[5:6], weight, 1e-5)[0])
    assert torch.equal(ops.silu_mul(gate_up)[5], ops.silu_mul(gate_up[5:6])[0])


def greedy_run(model: Transformer, ops: CpuOps | None) -> tuple[list[int], torch.Tensor]:
    """A chunked prompt and 6 greedy tokens through the runner, every layer's ops set to
    ``ops``: (tokens, the logits of every step)."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        runner, sched = StepRunner(model, receiver=None), ScriptedScheduler(16)
        req = ScriptedRequest("r", list(range(3, 40)), [], max_new_tokens=6, chunk_size=11)
        sched.run(runner.step, [req])
        runner.step(sched.flush())
    finally:
        hook.remove()
    return req.output, torch.cat(captured)


def test_the_decoder_with_the_compiled_ops_matches_the_torch_ops() -> None:
    model = build_model(PRESETS["tiny"], CPU, torch.float32)
    model.setup_caches(num_blocks=32, block_size=16)
    ops = cpu_ops()
    assert model.layers[0].feed_forward.ops is ops and model.norm.ops is ops  # set up

    fused_tokens, fused = greedy_run(model, ops)
    plain_tokens, plain = greedy_run(model, None)
    assert fused_tokens == plain_tokens
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
