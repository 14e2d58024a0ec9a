"""Token sampling: penalties, greedy, temperature, min-p, top-k, top-p, logprobs.

Pure functions over a batch of rows, vectorised over per-row parameters, with no host
sync (the caller reads the tokens once, to answer the step). The order is vLLM's, so the
parameters mean what they mean there::

    raw logits --> logprobs (what a client sees: the model's own distribution)
        |
        +--> token masks (structured output) --> mask stop ids (min_tokens)
                 --> penalties --> greedy: argmax
                                                 |
                                                 +--> / temperature --> min-p --> top-k,
                                                      top-p --> categorical draw

A categorical draw inverts the cumulative distribution: the first token whose running
sum of probabilities exceeds ``u * total``, which picks token i with probability
probs[i]. ``u``, uniform in [0, 1), is a hash of ``(seed, i)`` for output token i of a
request (:func:`uniform_draws`), so the same seed gives the same tokens even when a
request is preempted and resumed, or replayed by another worker of the cell.
NOTE: ``argmax(probs / E)`` with ``E ~ Exp(1)`` drawn per entry from a seeded generator
(vLLM's way) was replaced: one generator per row drawing a vocabulary of exponentials
took 0.9 ms a row at 49152 tokens and 2.4 ms at 151936 (13 and 40 ms for 16 rows, a
quarter of a batch-16 decode step of SmolLM2), against one number per row here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi: spreads consecutive indices over the seed space
_MASK64 = (1 << 64) - 1


def seed_for_request(request_id: str) -> int:
    """Seed of a request that brought none: derived from its id, so every rank agrees."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def token_seed(seed: int, output_index: int) -> int:
    return (seed + (output_index + 1) * _GOLDEN) & _MASK64


def uniform_draws(seeds: Sequence[int], device: torch.device) -> Tensor:
    """(R,) float64 in [0, 1): row r a function of ``seeds[r]`` alone (SplitMix64's
    finalizer over the 64-bit seed, its top 53 bits as the fraction)."""
    draws = []
    for seed in seeds:
        z = (seed ^ (seed >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
        draws.append(((z ^ (z >> 31)) >> 11) * 2.0 ** -53)
    return torch.tensor(draws, dtype=torch.float64).to(device)


def filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k and nucleus (top-p) to -inf.

    logits (R, V); top_k (R,) int64, <= 0 disables; top_p (R,) in (0, 1], 1 disables. The
    most likely token always survives.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R, V)
    rank = torch.arange(vocab, device=logits.device)  # (V,)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # (R,)
    drop = rank[None, :] >= k[:, None]  # (R, V)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (R, V)
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # 1: rounding-proof off
    drop[:, 0] = False
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, filtered)


def filter_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Set logits of tokens less likely than ``min_p`` times the row's top token to -inf.

    logits (R, V); min_p (R,) in [0, 1], 0 keeps every token. The top token survives.
    """
    probs = logits.softmax(dim=-1)  # (R, V)
    floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (R, 1)
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_penalties(logits: Tensor, prompt_mask: Tensor, output_counts: Tensor,
                    presence: Tensor, frequency: Tensor, repetition: Tensor) -> Tensor:
    """Penalised logits (R, V), by the formulas of vLLM and OpenAI.

    Repetition (CTRL's, over prompt and output): a token that occurs in either has a
    positive logit divided by ``repetition``, a negative one multiplied. Then OpenAI's,
    over the output only: ``- frequency * count - presence * (count > 0)``.

    logits (R, V) float32; prompt_mask (R, V) bool, the token occurs in the prompt;
    output_counts (R, V), its occurrences in the output so far; presence, frequency,
    repetition (R,) float32 (0, 0 and 1 leave a row unchanged).
    """
    counts = output_counts.to(logits.dtype)  # (R, V)
    in_output = counts > 0
    factor = torch.where(prompt_mask | in_output, repetition[:, None], 1.0)  # (R, V)
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    return logits - frequency[:, None] * counts - presence[:, None] * in_output


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor | None, top_p: Tensor | None,
           min_p: Tensor | None, uniforms: Tensor) -> Tensor:
    """Next tokens (R,) int64. Rows with temperature 0 are greedy (argmax of the logits).

    logits (R, V) float32, penalties and masks applied; temperature, top_p, min_p (R,)
    float32; top_k (R,) int64; uniforms (R,) from :func:`uniform_draws` (ignored for
    greedy rows). A filter no row uses may be None (the caller knows from the host-side
    parameters): its passes over the vocabulary are skipped (top-k/top-p sorts every row).
    """
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if min_p is not None:
        scaled = filter_min_p(scaled, min_p)
    if top_k is not None or top_p is not None:
        rows = logits.shape[0]
        scaled = filter_top_k_top_p(
            scaled,
            top_k if top_k is not None else torch.zeros(rows, dtype=torch.int64,
                                                        device=logits.device),
            top_p if top_p is not None else torch.ones(rows, device=logits.device))
    # float64: a float32 running sum over a 150k vocabulary drifts by ~1e-4 of the total
    cdf = scaled.softmax(dim=-1).double()  # (R, V)
    cdf.cumsum_(dim=-1)  # in place: a new (R, V) float64 tensor costs more than the sum
    target = (uniforms * cdf[:, -1])[:, None]
    drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-softmax of ``logits`` (R, V) at ``tokens`` (R,), and its ``k`` largest entries.

    Returns (R,) logprobs of the tokens, (R, k) top token ids and (R, k) their logprobs,
    most likely first.
    """
    logprobs = logits.log_softmax(dim=-1)  # (R, V)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]  # (R,)
    top, top_ids = logprobs.topk(k, dim=-1)  # (R, k)
    return chosen, top_ids, top


def refused_tokens(masks: Mapping[int, bytes], rows: int, vocab: int,
                   device: torch.device) -> Tensor:
    """(rows, vocab) bool: the tokens each row may NOT sample. ``masks`` maps a row to its
    packed bitmap (``worker.proto``'s ``token_masks``: little-endian int32 words, bit j of
    word i allows token 32 * i + j); rows without one refuse nothing. Tokens past a
    bitmap's end are refused (the model's vocabulary may be padded past the tokenizer's).

    Unpacked on the host in one pass over bytes (numpy's little-endian bit order is the
    bitmap's): shifting int32 words in torch builds a (rows, words, 32) int32 tensor,
    ~7x the work at a 152k vocabulary and 16 rows."""
    width = -(-vocab // 8)  # bytes covering the vocabulary
    refused = np.zeros((rows, width), dtype=np.uint8)
    for row, mask in masks.items():
        allowed = np.frombuffer(mask, dtype=np.uint8)[:width]
        refused[row, :allowed.size] = ~allowed
        refused[row, allowed.size:] = 0xFF
    bits = np.unpackbits(refused, axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_)).to(device)
