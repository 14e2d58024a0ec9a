"""Builds one step's ``ModelInputs`` from the scheduled requests.

For a request with ``c`` computed tokens and ``n`` scheduled ones::

    tokens   0 ............ c ........... c+n ...... len(token_ids)
             |  in the cache | this step    | known, later steps
             |<--------- kv_index: context read through the block table --->|(up to c+n)
                             |<- slots -->| K/V written here

Query i (position c + i) sees keys 0..c+i. Its logits are kept only when c + n reaches
the end of the known tokens (the prompt is complete, or a decode step), and then only for
the last row. Rows of placeholder tokens take their embeddings from the encoder cache:
row (p - offset) of the image's output for placeholder p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from worker_svc.encoder_cache import EncoderCache
from worker_svc.model import DecodeBatch, ModelInputs, SequenceSlice
from worker_svc.request_state import RequestState


@dataclass(frozen=True)
class StepBatch:
    inputs: ModelInputs
    sampling: list[RequestState]  # requests with a logits row, in ``logits_index`` order


def build_batch(scheduled: Sequence[tuple[RequestState, int]], encoder_cache: EncoderCache,
                block_size: int, device: torch.device) -> StepBatch:
    """Flatten ``(state, num_scheduled_tokens)`` pairs into the model's inputs.

    Single-token (decode) requests cost a few integer operations each here and are turned
    into tensors together, so a decode step's batch building does not grow by a tensor
    operation per request (bench/step_overhead.py, "worker bk")."""
    tokens: list[int] = []
    slots: list[int] = []
    positions: list[Tensor] = []  # (3, k) runs of rows, in row order
    columns: list[tuple[int, int, int]] = []  # decode rows' positions not yet in ``positions``
    mm_index, mm_embeds = [], []
    seqs, logits_index, sampling = [], [], []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lengths: list[int] = []
    for state, n in scheduled:
        c, q_start = state.num_computed_tokens, len(tokens)
        tokens.extend(state.token_ids[c:c + n])
        slots.extend(state.slot_ids(c, c + n, block_size))
        for f in state.features:
            lo, hi = max(c, f.mm_position.offset), min(c + n, f.mm_position.end)
            if lo < hi:
                rows = encoder_cache.get(f.identifier)[lo - f.mm_position.offset:
                                                       hi - f.mm_position.offset]
                mm_embeds.append(rows)
                mm_index.append(torch.arange(q_start + lo - c, q_start + hi - c))
        if n == 1:
            columns.append(state.position_of(c))
            decode_rows.append(q_start)
            decode_tables.append(state.block_ids)
            decode_lengths.append(c + 1)
        else:
            if columns:
                positions.append(torch.tensor(columns, dtype=torch.int64).T)
                columns = []
            positions.append(state.positions_between(c, c + n))
            seqs.append(SequenceSlice(
                q_start=q_start, q_end=q_start + n, context=c + n,
                block_table=torch.tensor([state.block_ids], dtype=torch.int64).to(
                    device, non_blocking=True),
                lengths=torch.arange(c + 1, c + n + 1).to(device, non_blocking=True),
                block_size=block_size,
            ))
        if c + n == state.num_tokens:
            logits_index.append(q_start + n - 1)
            sampling.append(state)
    if columns:
        positions.append(torch.tensor(columns, dtype=torch.int64).T)
    dim = encoder_cache.dim
    inputs = ModelInputs(
        tokens=torch.tensor(tokens, dtype=torch.int64).to(device, non_blocking=True),
        positions=torch.cat(positions, dim=1).to(device, non_blocking=True),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True),
        seqs=seqs,
        decode=_decode_batch(decode_rows, decode_tables, decode_lengths, block_size, device,
                             encoder_cache.dtype),
        mm_index=(torch.cat(mm_index) if mm_index else torch.empty(0, dtype=torch.int64)).to(
            device, non_blocking=True),
        mm_embeds=(torch.cat(mm_embeds) if mm_embeds
                   else torch.empty(0, dim, device=device, dtype=encoder_cache.dtype)),
        logits_index=torch.tensor(logits_index, dtype=torch.int64).to(device, non_blocking=True),
    )
    return StepBatch(inputs, sampling)


def _decode_batch(rows: list[int], tables: list[list[int]], lengths: list[int],
                  block_size: int, device: torch.device,
                  dtype: torch.dtype) -> DecodeBatch | None:
    """Single-token sequences: each context is the blocks holding slots 0..length-1,
    padded to the longest (a padded entry names block 0, never read: attention stops at
    each sequence's length)."""
    if not rows:
        return None
    width = -(-max(lengths) // block_size)
    padded = torch.tensor([(t + [0] * width)[:width] for t in tables],
                          dtype=torch.int64)  # (B, N)
    return DecodeBatch(
        rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        block_table=padded.to(device, non_blocking=True),
        lengths=torch.tensor(lengths, dtype=torch.int64).to(device, non_blocking=True),
        block_size=block_size, dtype=dtype,
    )

