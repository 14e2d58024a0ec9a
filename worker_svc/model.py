"""The decoder: a Llama-style transformer over a paged KV cache, with an optional vision tower.

Contents, top to bottom: ``ModelInputs`` (one step's flattened batch), ``PagedKVCache``,
``Transformer`` (token embedding, image-embedding splice, blocks, head), ``TransformerBlock``,
``Attention`` (grouped-query, rotary, paged), ``FeedForward`` (SwiGLU). The config and its
presets are in ``model_config.py``, RMSNorm and rotary in ``layers.py`` (shared with the
vision towers: the built-in one in ``vision.py``, Qwen2-VL's and Qwen2.5-VL's in
``qwen_vision.py``), weights on disk in ``checkpoint.py`` and ``hf_checkpoint.py``;
``tensor_parallel.py`` rewrites a built model into one rank's shard (per-layer head counts,
hooks), not this file.

One decoder serves the built-in model and the Hugging Face Llama/Qwen2 family: what differs
is config (biases, head size, tied head, RoPE vs M-RoPE), never a branch in ``forward``.
Rotary rotates interleaved pairs (2i, 2i+1); checkpoints that rotate half-vectors have their
q/k rows permuted once at load (``hf_checkpoint.py``).

A step's tokens from all requests are laid out flat, (T, dim): every linear layer runs on
the whole step at once, and only attention is split: each multi-token sequence (a prefill
chunk) attends on its own, and all single-token sequences (decodes) attend together in one
call, each context read through its block table: in place by the CPU kernel of
``cpu_attention.py`` (a prefill chunk's rows as decodes of their own, each seeing the slots
up to its position), else gathered (decodes padded to the longest, chunks under a causal
mask). Where every piece of a layer is compiled (CPU, float32), ``forward`` hands all the
layers to one compiled call (``cpu_decoder.py``), the same kernels in the same order.
NOTE: padding the whole batch to (B, max_q) was rejected: a step mixing one prefill chunk
with decodes would pad every decode to the chunk's length. For the same reason prefill and
decode share one ``forward`` (the unit a compiler would take) instead of two top-level
functions: chunked prefill mixes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker_svc.cpu_attention import PagedAttentionKernel, attention_kernel
from worker_svc.cpu_decoder import CpuDecoder, cpu_decoder
from worker_svc.cpu_ops import CpuOps, cpu_ops
from worker_svc.layers import (
    RMSNorm,
    apply_rotary,
    pair_components,
    rotary_for_positions,
    rotary_table,
)
from worker_svc.model_config import TANDEM, ModelConfig
from worker_svc.qwen_vision import QwenVisionEncoder
from worker_svc.vision import VisionEncoder


@dataclass(frozen=True)
class SequenceSlice:
    """Where one sequence's new tokens sit in the step and where its context lives."""

    q_start: int  # first row of the step's flat token layout
    q_end: int
    context: int  # S: positions 0..S-1 of the sequence are in the cache (S >= q_end-q_start)
    block_table: Tensor  # (1, N) int64: the sequence's blocks
    lengths: Tensor  # (Q,) int64: query i sees slots 0..lengths[i]-1 (causal: S-Q+1+i)
    block_size: int

    @cached_property
    def kv_index(self) -> Tensor:
        """(S,) cache slots of positions 0..S-1: the gathered path's, built on first use
        (the CPU kernel reads the blocks in place)."""
        pos = torch.arange(self.context, device=self.block_table.device)
        return self.block_table[0, pos // self.block_size] * self.block_size + pos % self.block_size

    @cached_property
    def mask(self) -> Tensor:
        """(Q, S) bool, True = visible: the gathered path's causal mask, built on first use."""
        keys = torch.arange(self.context, device=self.lengths.device)
        return keys[None, :] < self.lengths[:, None]


@dataclass(frozen=True)
class DecodeBatch:
    """All single-token sequences of a step, attended in one call."""

    rows: Tensor  # (B,) rows of the step's flat layout holding the queries
    block_table: Tensor  # (B, N) blocks of each context, padded to the longest (N blocks)
    lengths: Tensor  # (B,) int64: sequence b sees slots 0..lengths[b]-1 (>= 1)
    block_size: int
    dtype: torch.dtype  # the model's, the mask's

    @cached_property
    def mask(self) -> Tensor:
        """(B, 1, 1, N * block_size) float, 0 for a real key and -inf for padding: the
        gathered path's, built on first use and shared by the layers (a bool mask would
        be converted by every layer's attention)."""
        keys = torch.arange(self.block_table.shape[1] * self.block_size,
                            device=self.lengths.device)  # (N * block_size,)
        visible = keys[None, :] < self.lengths[:, None]  # (B, N * block_size)
        return torch.zeros(visible.shape, device=visible.device, dtype=self.dtype).masked_fill_(
            ~visible, float("-inf"))[:, None, None, :]


@dataclass(frozen=True)
class ModelInputs:
    """One step, flattened: T tokens of one or more sequences, back to back in ``seqs`` order."""

    tokens: Tensor  # (T,) int64
    positions: Tensor  # (3, T) int64: (t, h, w) components; equal rows under plain RoPE
    slot_mapping: Tensor  # (T,) cache slot (block * block_size + offset) each token writes
    seqs: list[SequenceSlice]  # the multi-token sequences
    decode: DecodeBatch | None  # the single-token ones (seqs and decode.rows cover 0..T)
    mm_index: Tensor  # (M,) rows of ``tokens`` whose embedding is an image embedding
    mm_embeds: Tensor  # (M, dim) those embeddings
    logits_index: Tensor  # (R,) rows whose next-token logits are returned


class PagedKVCache(nn.Module):
    """Keys and values of one layer in fixed-size blocks.

    Values are (num_blocks, block_size, n_kv_heads, head_dim); slot s is block
    s // block_size, offset s % block_size. Keys are the same, or with ``keys_by_dim``
    (num_blocks, n_kv_heads, head_dim, block_size): the CPU attention kernel's layout, in
    which a block's keys of one head are rows of slots (``cpu_attention.c``). Blocks
    belong to the scheduler: the cache never decides which slot holds what, it only
    writes and reads the slots it is given.
    """

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, keys_by_dim: bool = False) -> None:
        super().__init__()
        shape = (num_blocks, block_size, n_kv_heads, head_dim)
        key_shape = (num_blocks, n_kv_heads, head_dim, block_size) if keys_by_dim else shape
        self.keys_by_dim = keys_by_dim
        self.register_buffer("k_cache", torch.zeros(key_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def keys(self) -> Tensor:
        """The keys as (num_blocks, block_size, n_kv_heads, head_dim), whatever the layout
        (a view)."""
        return self.k_cache.permute(0, 3, 1, 2) if self.keys_by_dim else self.k_cache

    def update(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v (T, Hkv, D) at ``slots`` (T,)."""
        assert k.shape[0] == slots.shape[0], "one slot per token"
        if self.keys_by_dim:
            bs = self.v_cache.shape[1]
            self.keys()[slots // bs, slots % bs] = k
        else:
            self.k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
        self.v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    def gather(self, kv_index: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values at ``kv_index`` (S,), each (S, Hkv, D)."""
        bs, h, d = self.v_cache.shape[1:]
        keys = (self.keys()[kv_index // bs, kv_index % bs] if self.keys_by_dim
                else self.k_cache.view(-1, h, d).index_select(0, kv_index))
        return keys, self.v_cache.view(-1, h, d).index_select(0, kv_index)

    def gather_blocks(self, block_table: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of whole blocks, block_table (B, N) -> each (B, N * block_size,
        Hkv, D). One row per block: copying 16-slot blocks is several times faster than
        copying the same bytes slot by slot (``gather``)."""
        b, n = block_table.shape
        _, bs, h, d = self.v_cache.shape
        flat = block_table.view(-1)
        return (self.keys().index_select(0, flat).reshape(b, n * bs, h, d),
                self.v_cache.index_select(0, flat).view(b, n * bs, h, d))


def vision_tower(config: ModelConfig) -> VisionEncoder | QwenVisionEncoder | None:
    if not config.has_vision:
        return None
    return VisionEncoder(config) if config.model_type == TANDEM else QwenVisionEncoder(config)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = vision_tower(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.rope: Tensor | None = None
        self.rope_components: Tensor | None = None
        self.num_blocks, self.block_size = 0, 0
        # Set with the caches: every layer in one compiled call where each piece of it is
        # compiled (cpu_decoder.py), else None (layer by layer).
        self.decoder: CpuDecoder | None = None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from a CPU generator: same seed, same weights on any machine.

        Variance-preserving (std 1/sqrt(fan_in), unit embeddings) rather than GPT-2's 0.02:
        an untrained model with small weights is almost a bigram model whose greedy output
        soon repeats one token, which would make the equivalence tests prove little.
        """
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:  # norm scales
                p.fill_(1.0)
            else:  # Linear (out, in) and Embedding (vocab, dim)
                std = 1.0 if name == "tok_embeddings.weight" else p.shape[1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def setup_caches(self, num_blocks: int, block_size: int) -> None:
        """Allocate the paged KV cache and the rotary tables (the only allocation point)."""
        if (num_blocks, block_size) == (self.num_blocks, self.block_size):
            return
        c = self.config
        device, dtype = self.output.weight.device, self.output.weight.dtype
        cpu_kernel = device.type == "cpu" and dtype == torch.float32
        ops = cpu_ops() if cpu_kernel else None
        self.norm.ops = ops
        for layer in self.layers:
            layer.attention_norm.ops = layer.ffn_norm.ops = ops
            layer.attention.ops = layer.feed_forward.ops = ops
            a = layer.attention
            a.kernel = (attention_kernel(a.n_kv_heads, a.n_heads // a.n_kv_heads,
                                         c.head_dim, block_size) if cpu_kernel else None)
            a.kv_cache = PagedKVCache(num_blocks, block_size, a.n_kv_heads, c.head_dim, dtype,
                                      keys_by_dim=a.kernel is not None).to(device)
        self.decoder = cpu_decoder(self.layers)  # None unless every piece is compiled
        self.rope = rotary_table(c.head_dim // 2, c.max_seq_len, c.rope_theta, device,
                                 c.rope_llama3)
        self.rope_components = pair_components(c.mrope_section, device)
        if self.visual is not None:
            self.visual.setup_caches(device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def encode_image(self, pixel_values: Tensor, grid_h: int, grid_w: int) -> Tensor:
        """(h*w, C*T*P*P) patches -> (h*w/m^2, dim) embeddings, one per placeholder token."""
        assert self.visual is not None, "a text-only model has no vision tower (runner checks)"
        return self.visual(pixel_values.to(self.output.weight.dtype), grid_h, grid_w)

    def forward(self, inputs: ModelInputs) -> Tensor:
        """Next-token logits (R, vocab) in float32 for ``inputs.logits_index``."""
        assert self.rope is not None and self.rope_components is not None, "call setup_caches"
        h = self.tok_embeddings(inputs.tokens)  # (T, dim)
        h = h.index_copy(0, inputs.mm_index, inputs.mm_embeds.to(h.dtype))
        rot = rotary_for_positions(self.rope, inputs.positions, self.rope_components)
        if self.decoder is not None and self.decoder.applies(self.layers):
            h = self.decoder(h, rot, inputs)  # h: index_copy's fresh tensor, summed in place
        else:
            for layer in self.layers:
                h = layer(h, rot, inputs)
        return self.output(self.norm(h[inputs.logits_index])).float()  # (R, vocab)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, rot: Tensor, inputs: ModelInputs) -> Tensor:
        attended = self.attention(self.attention_norm(x), rot, inputs)
        h, normed = self.ffn_norm.add_forward(attended, x)  # h = x + attended
        return self.feed_forward(normed).add_(h)  # the GEMM's fresh output: summed in place


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads, config.n_kv_heads, config.head_dim)
        self.q_size = config.n_heads * config.head_dim
        self.kv_size = config.n_kv_heads * config.head_dim
        self.wqkv = nn.Linear(config.dim, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(self.q_size, config.dim, bias=config.out_bias)
        self.kv_cache: PagedKVCache | None = None
        # Set with the cache: the in-place CPU kernel where it applies, else None (gather).
        self.kernel: PagedAttentionKernel | None = None
        self.ops: CpuOps | None = None  # likewise: the compiled rotation and cache write

    def forward(self, x: Tensor, rot: Tensor, inputs: ModelInputs) -> Tensor:
        assert self.kv_cache is not None, "call setup_caches"
        t = x.shape[0]
        if self.ops is not None and self.kv_cache.keys_by_dim:  # the kernels' layout
            q = self.ops.rotate_into_cache(self.wqkv(x).contiguous(), rot, inputs.slot_mapping,
                                           self.kv_cache.k_cache, self.kv_cache.v_cache,
                                           self.n_heads)  # (T, H, D)
        else:
            q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(q.view(t, self.n_heads, self.head_dim), rot)  # (T, H, D)
            k = apply_rotary(k.view(t, self.n_kv_heads, self.head_dim), rot)  # (T, Hkv, D)
            v = v.view(t, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
            self.kv_cache.update(inputs.slot_mapping, k, v)
        if not inputs.seqs and inputs.decode is not None:  # decodes only: rows 0..T-1 in order
            return self.wo(self._attend_decode(q, inputs.decode).view(t, -1))
        out = torch.empty_like(q)  # (T, H, D)
        for s in inputs.seqs:
            out[s.q_start:s.q_end] = self._attend(q[s.q_start:s.q_end], s)
        if inputs.decode is not None:
            out[inputs.decode.rows] = self._attend_decode(q[inputs.decode.rows], inputs.decode)
        return self.wo(out.view(t, -1))  # (T, dim)

    def _attend(self, q: Tensor, seq: SequenceSlice) -> Tensor:
        """One sequence: q (Q, H, D) against its whole context read through the block table.

        Where the CPU kernel is built, it reads the blocks in place, each query row seeing
        the slots up to its position (``seq.lengths``): causal, no mask. Elsewhere the
        context is gathered and SDPA runs under the mask."""
        assert self.kv_cache is not None
        if self.kernel is not None:
            return self.kernel.prefill(q, self.kv_cache.k_cache, self.kv_cache.v_cache,
                                       seq.block_table[0], seq.lengths)
        k, v = self.kv_cache.gather(seq.kv_index)  # (S, Hkv, D)
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, S, D)
        v = v.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, S, D)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=seq.mask)
        return out.transpose(0, 1)  # (Q, H, D)

    def _attend_decode(self, q: Tensor, batch: DecodeBatch) -> Tensor:
        """B single queries q (B, H, D), each against its own context.

        On the CPU in float32 the compiled kernel reads the contexts in place
        (``cpu_attention.py``). Elsewhere they are gathered, padded to the longest, and
        the H query heads sharing a key head ride as that head's "query positions", all
        seeing every key, so grouped-query attention needs no repeated keys.
        NOTE: ``repeat_interleave`` of the keys and values to H heads was rejected: it copied
        the gathered context (n_heads / n_kv_heads) times per layer, a fifth of a batch-16
        decode step of SmolLM2 (docs/worker.md).
        """
        assert self.kv_cache is not None
        if self.kernel is not None:
            return self.kernel.decode(q, self.kv_cache.k_cache, self.kv_cache.v_cache,
                                      batch.block_table, batch.lengths)
        b = q.shape[0]
        k, v = self.kv_cache.gather_blocks(batch.block_table)  # (B, S, Hkv, D)
        q = q.view(b, self.n_kv_heads, -1, self.head_dim)  # (B, Hkv, H/Hkv, D)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=batch.mask
        )  # (B, Hkv, H/Hkv, D)
        return out.reshape(b, self.n_heads, self.head_dim)  # (B, H, D)


class FeedForward(nn.Module):
    """SwiGLU, the gate and up projections fused into one ``w13`` (gate rows, then up rows).

    NOTE: separate gate and up GEMMs were rejected: at decode sizes a GEMM's cost is
    mostly streaming its weights, and one call over both reads them once per call with
    half the calls (docs/worker.md)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=bias)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=bias)  # down
        self.ops: CpuOps | None = None  # the compiled SwiGLU, set with the model's caches

    def forward(self, x: Tensor) -> Tensor:
        if self.ops is not None:
            return self.w2(self.ops.silu_mul(self.w13(x).contiguous()))
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)
