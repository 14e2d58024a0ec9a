"""Reference implementations of the sampling formulas, for tests: plain Python, written
from the definitions (vLLM's order, OpenAI's and CTRL's penalties), sharing nothing with
``worker_svc.sampler``. Logits come from transformers' forward pass over the whole
sequence, recomputed per token (no cache)."""

from __future__ import annotations

from collections import Counter

import torch


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V) float64 next-token logits of transformers over ``tokens``."""
    with torch.no_grad():
        return hf(input_ids=torch.tensor([tokens])).logits[0].double()


def penalised(logits: list[float], prompt: list[int], output: list[int], presence: float,
              frequency: float, repetition: float) -> list[float]:
    """Repetition (CTRL) over prompt and output first, then frequency and presence over
    the output, one token at a time."""
    out = list(logits)
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t, count in Counter(output).items():
        out[t] -= frequency * count + presence
    return out


def greedy(hf: torch.nn.Module, prompt: list[int], n: int, presence: float = 0.0,
           frequency: float = 0.0, repetition: float = 1.0) -> list[int]:
    """``n`` greedy tokens under the penalties."""
    output: list[int] = []
    for _ in range(n):
        logits = hf_logits(hf, prompt + output)[-1].tolist()
        scores = penalised(logits, prompt, output, presence, frequency, repetition)
        output.append(max(range(len(scores)), key=scores.__getitem__))
    return output
