"""The CPU attention kernels (worker_svc/cpu_attention.py) against the gathered path
they replace: random caches, scattered block tables, every split of the work; for decodes
and for prefill chunks (their own kernel: tiles of query rows sharing each block)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from worker_svc.cpu_attention import attention_kernel
from worker_svc.cpu_build import torch_openmp
from worker_svc.model import Attention, DecodeBatch, PagedKVCache, SequenceSlice
from worker_svc.model_config import ModelConfig

needs_compiler = pytest.mark.skipif(
    shutil.which("cc") is None or torch_openmp() is None,
    reason="no C compiler, or torch without libgomp: the model gathers instead")


@contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


GEOMETRIES = [
    (3, 3, 64, 16),  # SmolLM2-135M
    (2, 7, 128, 16),  # Qwen2-VL-7B's grouping
    (4, 1, 16, 32),  # no grouping, the built-in preset's head size
    (1, 4, 80, 8),  # a head size that is no multiple of the vector width
]



def attention(n_kv_heads: int, n_rep: int, head_dim: int, block_size: int,
              num_blocks: int) -> Attention:
    """One layer's attention with a random cache (its projections are not used here)."""
    a = Attention(ModelConfig())
    a.n_kv_heads, a.n_heads, a.head_dim = n_kv_heads, n_kv_heads * n_rep, head_dim
    a.kv_cache = PagedKVCache(num_blocks, block_size, n_kv_heads, head_dim, torch.float32,
                              keys_by_dim=True)  # the kernels' layout
    a.kv_cache.k_cache.normal_()
    a.kv_cache.v_cache.normal_(std=2.0)
    return a


def decode_batch(lengths: list[int], block_size: int, num_blocks: int,
                 gen: torch.Generator) -> DecodeBatch:
    """Contexts in scattered, disjoint blocks, the table padded with block 0 as batch.py
    pads it."""
    width = -(-max(lengths) // block_size)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    for b, n in enumerate(lengths):
        used = -(-n // block_size)
        table[b, :used] = torch.tensor(order[:used])
        order = order[used:]
    return DecodeBatch(rows=torch.arange(len(lengths)), block_table=table,
                       lengths=torch.tensor(lengths), block_size=block_size,
                       dtype=torch.float32)


@needs_compiler
@pytest.mark.parametrize(("n_kv_heads", "n_rep", "head_dim", "block_size"), GEOMETRIES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_kernel_matches_gathered_attention(n_kv_heads: int, n_rep: int, head_dim: int,
                                           block_size: int, num_threads: int) -> None:
    gen = torch.Generator().manual_seed(n_kv_heads * 1000 + head_dim)
    num_blocks = 200
    a = attention(n_kv_heads, n_rep, head_dim, block_size, num_blocks)
    kernel = attention_kernel(n_kv_heads, n_rep, head_dim, block_size)
    assert kernel is not None
    # One sequence (work split per key head) and many (per sequence); lengths of one slot,
    # of whole blocks and in between.
    for lengths in ([1], [3 * block_size + 5], [1, block_size, 2 * block_size, 7, 130, 57,
                                                   block_size + 1, 64, 99, 3]):
        batch = decode_batch(lengths, block_size, num_blocks, gen)
        q = torch.randn(len(lengths), n_kv_heads * n_rep, head_dim, generator=gen)
        with threads(num_threads):
            a.kernel = None
            expected = a._attend_decode(q, batch)
            a.kernel = kernel
            got = a._attend_decode(q, batch)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize(("computed", "new"), [(0, 37), (45, 20), (16, 16), (0, 2), (3, 1)])
@pytest.mark.parametrize(("n_kv_heads", "n_rep", "head_dim", "block_size"), GEOMETRIES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_prefill_chunk_through_the_kernel_matches_the_masked_gather(
        computed: int, new: int, n_kv_heads: int, n_rep: int, head_dim: int, block_size: int,
        num_threads: int) -> None:
    """A chunk of ``new`` tokens after ``computed`` cached ones (a prefix hit, or an
    earlier chunk): query i sees slots 0..computed+i, as the causal mask says. Rows in
    tiles of 8 and a partial one (37), a chunk inside one block (2), a single row (1)."""
    gen = torch.Generator().manual_seed(computed * 100 + new + head_dim)
    num_blocks = 64
    a = attention(n_kv_heads, n_rep, head_dim, block_size, num_blocks)
    kernel = attention_kernel(n_kv_heads, n_rep, head_dim, block_size)
    assert kernel is not None
    total = computed + new
    blocks = torch.randperm(num_blocks, generator=gen)[:-(-total // block_size) + 1]
    seq = SequenceSlice(q_start=0, q_end=new, context=total, block_table=blocks[None, :],
                        lengths=torch.arange(computed + 1, total + 1), block_size=block_size)
    q = torch.randn(new, n_kv_heads * n_rep, head_dim, generator=gen)
    with threads(num_threads):
        a.kernel = None
        expected = a._attend(q, seq)
        a.kernel = kernel
        got = a._attend(q, seq)
        direct = kernel.prefill(q, a.kv_cache.k_cache, a.kv_cache.v_cache, blocks,
                                seq.lengths)
        # Cut at a row that is no multiple of the tile: each row's answer stays the same.
        cut = new // 3
        halves = torch.cat([kernel.prefill(q[rows], a.kv_cache.k_cache, a.kv_cache.v_cache,
                                           blocks, seq.lengths[rows])
                            for rows in (slice(0, cut), slice(cut, new))])
        # The same rows as decodes (each its own table row): the same per-row code.
        decoded = kernel.decode(q, a.kv_cache.k_cache, a.kv_cache.v_cache,
                                blocks[None, :].expand(new, -1), seq.lengths)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, direct)  # the kernel's own answer, not the gather's
    assert torch.equal(halves, direct)
    assert torch.equal(decoded, direct)  # a position's bits: prefilled or decoded alike


@needs_compiler
def test_loading_the_kernel_keeps_subnormal_floats() -> None:
    """A library linked with -ffast-math turns on flush-to-zero for the whole process when
    it loads (crtfastmath.o), which broke hypothesis's float strategies in the fuzz tests."""
    build = attention_kernel.__wrapped__  # a fresh build and load, not the per-process cache
    assert build(2, 2, 32, 16) is not None
    tiny = float.fromhex("0x1p-1074")  # the smallest subnormal double
    assert tiny * float(len("x")) > 0.0  # computed at run time, not folded by the compiler
    assert (torch.tensor([1e-40], dtype=torch.float32) * 3).item() > 0.0


@needs_compiler
def test_kernel_rejects_a_layout_it_was_not_built_for() -> None:
    kernel = attention_kernel(3, 3, 64, 16)
    assert kernel is not None
    a = attention(3, 3, 64, 16, 8)
    assert a.kv_cache is not None
    table, lengths = torch.zeros(2, 1, dtype=torch.int64), torch.tensor([3, 5])
    with pytest.raises(ValueError, match="called with q"):  # head size 32, not 64
        kernel.decode(torch.randn(2, 9, 32), a.kv_cache.k_cache, a.kv_cache.v_cache, table,
                      lengths)
    with pytest.raises(ValueError, match="called with q"):  # int32 table
        kernel.decode(torch.randn(2, 9, 64), a.kv_cache.k_cache, a.kv_cache.v_cache,
               table.int(), lengths)


@pytest.mark.skipif(torch_openmp() is None, reason="torch without libgomp: the build stops "
                    "before it tries a compiler")
def test_without_a_compiler_attention_gathers_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    build = attention_kernel.__wrapped__  # not the per-process cache
    monkeypatch.setenv("CC", "tandem-no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="worker_svc.cpu_build"):
        assert build(3, 3, 64, 16) is None
    assert "no C compiler ($CC or cc) on PATH" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CC", "false")  # found, but compiles nothing
    with caplog.at_level(logging.WARNING, logger="worker_svc.cpu_build"):
        assert build(3, 3, 64, 16) is None
    assert "failed" in caplog.text
    caplog.clear()
    # A "compiler" that succeeds but leaves a file no loader takes (as a library in a
    # directory mounted noexec would be refused): the worker gathers, it does not crash.
    empty = tmp_path / "empty-cc"
    empty.write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\n: > "$2"\n')
    empty.chmod(0o755)
    monkeypatch.setenv("CC", str(empty))
    with caplog.at_level(logging.WARNING, logger="worker_svc.cpu_build"):
        assert build(3, 3, 64, 16) is None
    assert "the compiled kernel could not be loaded" in caplog.text
