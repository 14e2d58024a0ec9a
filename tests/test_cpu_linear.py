"""Linear layers laid out for the CPU's GEMM compute what ``F.linear`` computes, in both
layouts: column panels (our ``cpu_gemm.c``) and oneDNN's blocked layout.

The equivalence with transformers through the layout this machine gets is in
test_hf_model.py (its ``load`` packs, as the worker does); here: what is replaced, the
numbers of one layer at the sizes a step uses, and where packing does not apply.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.checkpoint import build_model
from worker_svc.cpu_linear import (
    PackedLinear,
    PanelLinear,
    can_pack,
    pack_linears,
    padded_rows,
    panel_gemm,
)
from worker_svc.model_config import PRESETS

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(not can_pack(CPU, torch.float32),
                                  reason="this torch build has no oneDNN")
needs_kernel = pytest.mark.skipif(panel_gemm() is None,
                                  reason="no C compiler or libgomp: the panel GEMM cannot "
                                  "be built here (the worker keeps oneDNN's layout)")
LAYOUTS = [pytest.param(True, PanelLinear, marks=needs_kernel, id="panels"),
           pytest.param(False, PackedLinear, marks=needs_onednn, id="onednn")]


@pytest.mark.parametrize(("panels", "kind"), LAYOUTS)
def test_every_linear_is_packed_and_the_logits_stay(panels: bool, kind: type) -> None:
    model = build_model(PRESETS["tiny"], CPU, torch.float32)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    plain = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    x = {name: torch.randn(5, m.in_features) for name, m in plain.items()}
    want = {name: m(x[name]) for name, m in plain.items()}

    assert pack_linears(model, panels=panels) == linears > 0
    packed = dict(model.named_modules())
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    for name, out in want.items():
        assert isinstance(packed[name], kind)
        torch.testing.assert_close(packed[name](x[name]), out, atol=1e-5, rtol=1e-5)
    # The tied head got its own packed copy; the embedding table is still the lookup.
    assert model.tok_embeddings.weight.layout == torch.strided


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 16, 300])
def test_a_packed_layer_at_step_sizes(rows: int) -> None:
    linear = nn.Linear(96, 160)
    x = torch.randn(rows, 96)[:, :].t().contiguous().t()  # column-major: not contiguous
    torch.testing.assert_close(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 16, 17, 300])
@pytest.mark.parametrize(("out_features", "bias"), [(160, True), (100, False), (5, True)])
def test_a_panel_layer_at_step_sizes(rows: int, out_features: int, bias: bool) -> None:
    """Full and partial row tiles, and widths the panels pad (100, 5 columns)."""
    gemm = panel_gemm()
    assert gemm is not None
    linear = nn.Linear(96, out_features, bias=bias)
    x = torch.randn(rows, 96).t().contiguous().t()  # column-major: not contiguous
    got = PanelLinear(linear, gemm)(x)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, linear.weight, linear.bias),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    """Each output is a sum over k in order, whatever the row count and whichever tiling
    it takes (one pass up to 16 rows, tiles of 8 above): the same request gets
    bit-identical logits alone or batched with others."""
    gemm = panel_gemm()
    assert gemm is not None
    layer = PanelLinear(nn.Linear(576, 1536), gemm)
    x = torch.randn(37, 576)
    batched = layer(x)
    for i in (0, 8, 36):
        assert torch.equal(layer(x[i:i + 1]), batched[i:i + 1])
    for rows in (5, 16):
        assert torch.equal(layer(x[:rows]), batched[:rows])


@needs_kernel
def test_the_panel_kernel_rejects_a_layout_it_cannot_read() -> None:
    gemm = panel_gemm()
    assert gemm is not None
    panels = gemm.panels(torch.randn(64, 32))
    with pytest.raises(ValueError, match="panel GEMM called with"):
        gemm(torch.randn(3, 31), panels)  # 31 features, the panels hold 32
    with pytest.raises(ValueError, match="panel GEMM called with"):
        gemm(torch.randn(3, 32, dtype=torch.float64), panels)


def test_nothing_is_packed_outside_cpu_float32() -> None:
    model = build_model(PRESETS["tiny"], CPU, torch.bfloat16)
    assert pack_linears(model) == 0
    assert isinstance(model.output, nn.Linear)
    assert not can_pack(torch.device("cuda"), torch.float32)


@needs_onednn
def test_rows_are_padded_to_few_sizes() -> None:
    """oneDNN keeps a primitive, with its own buffers, per row count: a serving step's
    1..512 rows must map to a few sizes (unpadded, a worker grew by ~2.6 GB over them)."""
    sizes = {n: padded_rows(n) for n in range(1, 513)}
    assert len(set(sizes.values())) == 5 + 31  # 1, 2, 4, 8, 16; then 32, 48, ..., 512
    assert all(n <= p < 2 * n for n, p in sizes.items() if n <= 16)
    assert all(n <= p < n + 16 and p % 16 == 0 for n, p in sizes.items() if n > 16)
