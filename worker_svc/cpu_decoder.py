"""The decoder's layers on the CPU in one call (``cpu_decoder.c``), where every piece of a
layer is compiled: the attention kernel (``cpu_attention.py``), the elementwise passes
(``cpu_ops.py``) and linear layers in column panels (``cpu_linear.py``).

Layer by layer, a step calls ~12 kernels per layer from Python. Measured on SmolLM2-135M
(2 AVX-512 cores, batch-16 decode step of ~50 ms): a fifth of the main thread's time went to
the Python around the calls (checks, torch allocations, ctypes), and meanwhile the team's
other thread spun at OpenMP's barrier (docs/worker.md, "The layers in one call"). Here one
call runs them all on one OpenMP team; the kernels are the same functions on the same rows,
so the logits are the same bits as layer by layer (``tests/test_cpu_decoder.py``).

The model takes this path when :func:`cpu_decoder` finds every piece in place at
``setup_caches`` and, each step, the layers still as they were then
(:meth:`CpuDecoder.applies`): a forward hook (tensor parallelism's all-reduce), a kernel
switched off or a padded GEMM output sends the step layer by layer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from worker_svc.cpu_attention import PagedAttentionKernel
from worker_svc.cpu_build import build_library
from worker_svc.cpu_linear import PANEL, PanelGemm, PanelLinear
from worker_svc.cpu_ops import CpuOps

# model.py imports this module: its types are spelled here as what they are to this code,
# a block (TransformerBlock) Any, like a step's inputs (ModelInputs).
Block = Any

SOURCE = Path(__file__).with_name("cpu_decoder.c")


def _ptr(t: Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _int64_rows(*tensors: Tensor) -> bool:
    return all(t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous()
               for t in tensors)


class CpuDecoder:
    """The layers of one model, run by ``decoder_layers`` of ``cpu_decoder.c``."""

    def __init__(self, library: ctypes.CDLL, layers: Sequence[Block],
                 gemm: PanelGemm, kernel: PagedAttentionKernel, ops: CpuOps) -> None:
        first = layers[0]
        a, ff = first.attention, first.feed_forward
        assert a.kv_cache is not None  # cpu_decoder checked every layer
        self.dim, self.n_heads, self.n_kv_heads, self.head_dim = (
            a.wo.out_features, a.n_heads, a.n_kv_heads, a.head_dim)
        self.inter = ff.w2.in_features
        self.eps, self.scale = first.attention_norm.eps, a.head_dim ** -0.5
        self.block_size, self.num_slots = a.kv_cache.v_cache.shape[1], (
            a.kv_cache.v_cache.shape[0] * a.kv_cache.v_cache.shape[1])
        # floats of the C code's scratch per token (its buffers, in its order)
        self.work_per_token = (3 * self.dim + (3 * self.n_heads + 2 * self.n_kv_heads)
                               * self.head_dim + 3 * self.inter)
        self._fn = library.decoder_layers
        self._fn.restype = ctypes.c_int64
        p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._fn.argtypes = ([p, p, i32, p, p, p, p, p, i64] + [i32] * 6
                             + [i64, ctypes.c_float, ctypes.c_float, i32])
        self._kernels = torch.tensor([gemm.part, ops.parts["norm"],
                                      ops.parts["silu"], ops.parts["rotate"], kernel.part],
                                     dtype=torch.int64)
        self._weights = torch.tensor([[
            _ptr(b.attention_norm.weight), _ptr(b.attention.wqkv.weight),
            _ptr(b.attention.wqkv.bias), _ptr(b.attention.wo.weight), _ptr(b.attention.wo.bias),
            _ptr(b.ffn_norm.weight), _ptr(b.feed_forward.w13.weight),
            _ptr(b.feed_forward.w13.bias), _ptr(b.feed_forward.w2.weight),
            _ptr(b.feed_forward.w2.bias), _ptr(b.attention.kv_cache.k_cache),
            _ptr(b.attention.kv_cache.v_cache)] for b in layers], dtype=torch.int64)
        # What the addresses above were read from (kept alive here), each as the dict that
        # holds it (a module's submodules live in its ``_modules``, other attributes in its
        # ``__dict__``), and every module's hooks: a step goes layer by layer when a piece
        # was swapped since (a kernel switched off) or a hook waits on a module (tensor
        # parallelism's all-reduce). Flat lists of dict lookups, because the check runs
        # every step: walked module by module with getattr it took 0.7 ms over 30 layers.
        self._pieces = [(_holder(owner, name), name, getattr(owner, name)) for b in layers
                        for owner, name in _pieces_of(b)]
        self._hooks = [d for b in layers for d in _hook_dicts(b)]
        self._layers = len(layers)

    def applies(self, layers: Sequence[nn.Module]) -> bool:
        """Whether ``layers`` are still the ones it was built on, every piece compiled and
        no hook attached."""
        return (len(layers) == self._layers
                and all(held.get(name) is value for held, name, value in self._pieces)
                and not any(self._hooks))

    def plan(self, inputs: Any) -> Tensor:
        """The step's attention for ``paged_attention_part`` (``cpu_attention.c``): the
        decodes' table, lengths and rows, then each chunk's first row, rows, blocks and
        lengths, tensors as addresses. The C code trusts them, so their layouts are
        checked here; block ids and lengths are the runner's to refuse, as on the layer by
        layer path."""
        t = inputs.tokens.shape[0]
        head = [len(inputs.seqs), 0, 0, 0, 0, 0]
        d = inputs.decode
        if d is not None:
            b = d.rows.shape[0]
            if (not _int64_rows(d.rows, d.lengths) or d.block_table.dtype != torch.int64
                    or d.block_table.dim() != 2 or d.block_table.shape[0] != b
                    or d.block_table.stride(1) != 1 or d.lengths.shape != (b,)
                    or (b and not 0 <= int(d.rows.min()) <= int(d.rows.max()) < t)):
                raise ValueError("a decode batch the CPU decoder cannot read: rows "
                                 f"{tuple(d.rows.shape)}, table {tuple(d.block_table.shape)}, "
                                 f"lengths {tuple(d.lengths.shape)}")
            head[1:] = [b, d.block_table.stride(0), d.block_table.data_ptr(),
                        d.lengths.data_ptr(), d.rows.data_ptr()]
        chunks: list[int] = []
        for s in inputs.seqs:
            table = s.block_table[0]
            if (not _int64_rows(table, s.lengths) or s.lengths.shape != (s.q_end - s.q_start,)
                    or not 0 <= s.q_start < s.q_end <= t):
                raise ValueError(f"a prefill chunk the CPU decoder cannot read: rows "
                                 f"{s.q_start}..{s.q_end} of {t}, lengths "
                                 f"{tuple(s.lengths.shape)}")
            chunks += [s.q_start, s.q_end - s.q_start, table.data_ptr(), s.lengths.data_ptr()]
        return torch.tensor(head + chunks, dtype=torch.int64)

    def __call__(self, h: Tensor, rot: Tensor, inputs: Any) -> Tensor:
        """h (T, dim), the embeddings, through every layer, in place (h must be the
        caller's own tensor)."""
        t = h.shape[0]
        cs = torch.view_as_real(rot)
        slots = inputs.slot_mapping
        if (h.shape != (t, self.dim) or h.dtype != torch.float32 or not h.is_contiguous()
                or cs.shape != (t, self.head_dim // 2, 2) or cs.dtype != torch.float32
                or not cs.is_contiguous() or slots.shape != (t,) or not _int64_rows(slots)):
            raise ValueError(f"the CPU decoder called with h {tuple(h.shape)} {h.dtype}, rot "
                             f"{tuple(rot.shape)}, slots {tuple(slots.shape)} {slots.dtype}")
        plan = self.plan(inputs)
        work = torch.empty(t * self.work_per_token)
        bad = self._fn(self._kernels.data_ptr(), self._weights.data_ptr(), self._layers,
                       h.data_ptr(), work.data_ptr(), cs.data_ptr(), slots.data_ptr(),
                       plan.data_ptr(), t, self.dim, self.n_heads, self.n_kv_heads,
                       self.head_dim, self.inter, self.block_size, self.num_slots, self.eps,
                       self.scale, torch.get_num_threads())
        if bad:
            raise IndexError(f"{bad} of {t} cache slots out of range "
                             f"(0..{self.num_slots - 1})")
        return h


@cache
def decoder_library() -> ctypes.CDLL | None:
    """``cpu_decoder.c``, built once per process; None (and a warning) where it cannot be."""
    return build_library(SOURCE, [], "the decoder's layers run one by one")


def cpu_decoder(layers: Sequence[Block]) -> CpuDecoder | None:
    """The one-call decoder for ``layers`` where every piece of every layer is compiled,
    their GEMM outputs unpadded and no hook attached; else None (layer by layer)."""
    first = layers[0] if layers else None
    if (first is None or first.attention.kernel is None or first.attention.ops is None
            or not isinstance(first.attention.wo, PanelLinear)):
        return None
    kernel, ops, gemm = first.attention.kernel, first.attention.ops, first.attention.wo.gemm
    shape = _shape(first)
    dim, heads, kv_heads, head_dim, inter = (first.attention.wo.out_features,
                                             first.attention.n_heads,
                                             first.attention.n_kv_heads,
                                             first.attention.head_dim,
                                             first.feed_forward.w2.in_features)
    # (in, out) of wqkv, wo, w13, w2 as the C code reads them
    if shape[:8] != (dim, (heads + 2 * kv_heads) * head_dim, heads * head_dim, dim, dim,
                     2 * inter, inter, dim):
        return None
    for b in layers:
        a, ff = b.attention, b.feed_forward
        if (_shape(b) != shape or a.kernel is not kernel or a.kv_cache is None
                or not a.kv_cache.keys_by_dim
                or any(m is not ops for m in (a.ops, ff.ops, b.attention_norm.ops,
                                              b.ffn_norm.ops))
                or not all(_panels(m, gemm) for m in (a.wqkv, a.wo, ff.w13, ff.w2))
                or not all(_floats(n.weight, dim) for n in (b.attention_norm, b.ffn_norm))
                or any(_hook_dicts(b))):
            return None
    library = decoder_library()
    return None if library is None else CpuDecoder(library, layers, gemm, kernel, ops)


def _holder(owner: nn.Module, name: str) -> dict[str, object]:
    """The dict in which ``owner`` keeps attribute ``name``."""
    return owner._modules if name in owner._modules else vars(owner)  # type: ignore[return-value]


def _hook_dicts(b: Block) -> list[dict]:
    """The forward hooks (and pre-hooks) of every module of block ``b``, each a dict that
    registering a hook adds to: any non-empty one sends the step layer by layer."""
    return [d for m in b.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]


def _pieces_of(b: Block) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of each piece of block ``b`` that the decoder reads."""
    a, ff = b.attention, b.feed_forward
    return [(a, "kernel"), (a, "ops"), (a, "kv_cache"), (a, "wqkv"), (a, "wo"), (ff, "ops"),
            (ff, "w13"), (ff, "w2"), (b.attention_norm, "ops"), (b.ffn_norm, "ops"),
            (b, "attention"), (b, "feed_forward"), (b, "attention_norm"), (b, "ffn_norm")]


def _shape(b: Block) -> tuple[object, ...]:
    a, ff = b.attention, b.feed_forward
    return (a.wqkv.in_features, a.wqkv.out_features, a.wo.in_features, a.wo.out_features,
            ff.w13.in_features, ff.w13.out_features, ff.w2.in_features, ff.w2.out_features,
            a.n_heads, a.n_kv_heads, a.head_dim, b.attention_norm.eps, b.ffn_norm.eps)


def _floats(t: Tensor, n: int) -> bool:
    return (t.shape == (n,) and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.is_contiguous())


def _panels(m: nn.Module, gemm: PanelGemm) -> bool:
    """A panel layer of ``gemm`` whose output is unpadded, its bias (if any) float32."""
    return (isinstance(m, PanelLinear) and m.gemm is gemm
            and m.weight.shape[0] * PANEL == m.out_features
            and (m.bias is None or _floats(m.bias, m.out_features)))
