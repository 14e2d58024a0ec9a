"""The paged worker path equals a plain, non-paged forward of the same model.

For a prompt with two images, greedy decoding through the StepRunner (paged KV cache,
block tables, encoder cache) with a cold cache, with the prefix fully cached by an
earlier identical request, and with chunked prefill in small chunks that cut through the
images, gives the token ids of a reference that recomputes the whole sequence every
token with causal attention and no cache; logits agree within LOGITS_ATOL (float32 on
CPU; the paths differ only in summation order; another device and dtype, and bf16's
tolerance: tandem_testing/device.py). Both RoPE and M-RoPE.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.features import MultiModalFeatureSpec, MultiModalKwargsItem
from tandem.strip import strip_covered_mm_data
from tandem_testing.device import DEVICE, DTYPE, REDUCED, assert_greedy_close
from tandem_testing.scripted import (
    ScriptedRequest,
    ScriptedScheduler,
    synthetic_image,
    synthetic_prompt,
)
from worker_svc.checkpoint import build_model
from worker_svc.layers import apply_rotary, rotary_for_positions
from worker_svc.model import Transformer
from worker_svc.model_config import PRESETS
from worker_svc.positions import ImageSpan, mrope_positions, rope_positions
from worker_svc.request_state import IMAGE_GRID_THW
from worker_svc.runner import StepRunner

LOGITS_ATOL = 1e-4  # observed max difference ~2e-6
BLOCK_SIZE = 4
MAX_NEW = 6


def reference_logits(model: Transformer, tokens: list[int], positions: torch.Tensor,
                     image_rows: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Logits (n, V) of every position: full causal attention, no cache, no block tables."""
    n = len(tokens)
    h = model.tok_embeddings(torch.tensor(tokens, device=DEVICE))
    for offset, embeds in image_rows:
        h[offset:offset + embeds.shape[0]] = embeds
    rot = rotary_for_positions(model.rope, positions.to(DEVICE), model.rope_components)
    for layer in model.layers:
        a = layer.attention
        q, k, v = a.wqkv(layer.attention_norm(h)).split([a.q_size, a.kv_size, a.kv_size], -1)
        q = apply_rotary(q.view(n, a.n_heads, a.head_dim), rot).transpose(0, 1)
        k = apply_rotary(k.view(n, a.n_kv_heads, a.head_dim), rot).transpose(0, 1)
        v = v.view(n, a.n_kv_heads, a.head_dim).transpose(0, 1)
        rep = a.n_heads // a.n_kv_heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 0),
                                             v.repeat_interleave(rep, 0), is_causal=True)
        h = h + a.wo(out.transpose(0, 1).reshape(n, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h)).float()


def reference_generate(model: Transformer, tokens: list[int],
                       features: list[MultiModalFeatureSpec]) -> tuple[list[int], torch.Tensor]:
    """Greedy ids and the logits that chose them (MAX_NEW, V)."""
    image_rows, spans = [], []
    for f in features:
        assert isinstance(f.data, MultiModalKwargsItem)
        _, gh, gw = (int(x) for x in f.data[IMAGE_GRID_THW].data[0])
        image_rows.append((f.mm_position.offset,
                           model.encode_image(f.data["pixel_values"].data.to(DEVICE), gh, gw)))
        spans.append(ImageSpan(f.mm_position.offset, gh // 2, gw // 2))
    seq, out, chosen = list(tokens), [], []
    for _ in range(MAX_NEW):
        if model.config.uses_mrope:
            pos, nxt = mrope_positions(len(tokens), spans)
        else:
            pos, nxt = rope_positions(len(tokens))
        later = nxt + torch.arange(len(seq) - len(tokens)).expand(3, -1)
        logits = reference_logits(model, seq, torch.cat([pos, later], 1), image_rows)[-1]
        chosen.append(logits)
        out.append(int(logits.argmax()))
        seq.append(out[-1])
    return out, torch.stack(chosen)


@pytest.fixture(scope="module", params=["tiny", "tiny-mrope"])
def setup(request: pytest.FixtureRequest):
    config = PRESETS[request.param]
    model = build_model(config, DEVICE, DTYPE)
    model.setup_caches(num_blocks=128, block_size=BLOCK_SIZE)
    images = [("img-a", synthetic_image(config, 4, 6, seed=1)),  # merged 2x3
              ("img-b", synthetic_image(config, 6, 4, seed=2))]  # merged 3x2
    tokens, features = synthetic_prompt(config, ["Look: ", " and ", " -- the same?"], images)
    with torch.inference_mode():
        ref = reference_generate(model, tokens, features)
    return model, tokens, features, ref


def run_paged(model: Transformer, sched: ScriptedScheduler, runner: StepRunner,
              req: ScriptedRequest) -> tuple[list[int], torch.Tensor]:
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        sched.run(runner.step, [req])
        runner.step(sched.flush())
    finally:
        hook.remove()
    runner.check_invariants()
    return req.output, torch.cat([c for c in captured if c.shape[0]])


def test_cold_cached_and_chunked_match_reference(setup) -> None:
    model, tokens, features, (ref_ids, ref_logits) = setup
    runner, sched = StepRunner(model, receiver=None), ScriptedScheduler(BLOCK_SIZE)
    assert len(set(ref_ids)) > 1, "degenerate reference: the test would prove little"

    cold = ScriptedRequest("cold", tokens, features, MAX_NEW)
    ids, logits = run_paged(model, sched, runner, cold)
    assert_greedy_close(ids, ref_ids, ref_logits, LOGITS_ATOL, logits)

    # Prefix hit: every full prompt block but the one holding the last token.
    hit = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert all(f.is_covered(hit) for f in features), "the prefix should cover both images"
    sent = list(strip_covered_mm_data(features, hit, model.config.uses_mrope))
    assert all(s.data is not f.data for s, f in zip(sent, features, strict=True)), "stripped"
    cached = ScriptedRequest("cached", tokens, sent, MAX_NEW,
                             prefix_blocks=cold.block_ids[:hit // BLOCK_SIZE],
                             num_computed_tokens=hit)
    ids, logits = run_paged(model, sched, runner, cached)
    assert_greedy_close(ids, ref_ids, ref_logits, LOGITS_ATOL, logits)
    assert cached.block_ids[:hit // BLOCK_SIZE] == cold.block_ids[:hit // BLOCK_SIZE]

    chunked = ScriptedRequest("chunked", tokens, features, MAX_NEW, chunk_size=5)
    ids, logits = run_paged(model, sched, runner, chunked)
    assert_greedy_close(ids, ref_ids, ref_logits, LOGITS_ATOL, logits)
    assert not runner.requests and not runner.encoder_cache.entries, "all state released"


def test_requests_stepped_together_match_each_alone(setup) -> None:
    """Decodes of different context lengths share one padded attention call, next to a
    prefill chunk of another request: every request still gets its own tokens."""
    model, tokens, features, (ref_ids, ref_logits) = setup
    short = tokens[:7]  # BOS + "Look: ": text only, a much shorter context

    def requests() -> list[ScriptedRequest]:
        return [ScriptedRequest("full", tokens, features, MAX_NEW),
                ScriptedRequest("short", short, [], MAX_NEW + 3),
                ScriptedRequest("chunked", tokens, features, MAX_NEW, chunk_size=5)]

    alone = []
    for req in requests():
        ScriptedScheduler(BLOCK_SIZE).run(StepRunner(model, receiver=None).step, [req])
        alone.append(req.output)
    together = requests()
    ScriptedScheduler(BLOCK_SIZE).run(StepRunner(model, receiver=None).step, together)
    if not REDUCED:
        assert [r.output for r in together] == alone
    # In bf16 a batch of other rows may round differently than alone (another GEMM kernel):
    # each request then agrees with the reference up to a near-tie.
    for req in (together[0], together[2]):
        assert_greedy_close(req.output, ref_ids, ref_logits, LOGITS_ATOL)
