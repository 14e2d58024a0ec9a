"""Real Hugging Face checkpoints through a real ``tandem serve --model DIR``, against
transformers on the same files.

The tiny Qwen2-VL / Qwen2.5-VL checkpoints carry the real Qwen vocabulary (151936 rows, the
special tokens at their real ids), the tokenizer and a Qwen2-VL-style chat template
(tandem_testing/text_checkpoints.py), a ``preprocessor_config.json`` (the directory:
tandem_testing/vl_checkpoints.py ``vl_model_dir``) and random untied weights with non-zero biases
(tests/hf_checkpoints.py). The reference renders the same messages with
transformers' ``apply_chat_template``, processes the same PNG files with its own image
processor, expands each ``<|image_pad|>`` to the image's embedding count and runs
``generate``; Tandem must give the same greedy ids, cold, from the prefix cache, with
chunked prefill and batched.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hf_checkpoints import reference, smollm2_dir
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tandem.v1 import generate_pb2
from tandem_testing.cells import Cell, png, running_cell
from tandem_testing.text_checkpoints import qwen2_vl_dir, reference_tokenizer
from tandem_testing.vl_checkpoints import QWEN_VL_IDS, QWEN_VOCAB, vl_model_dir

IMAGE_PAD = QWEN_VL_IDS["image_token_id"]
MAX_NEW = 8


def chat(*parts: str | bytes, system: str = "") -> generate_pb2.GenerateRequest:
    """One user turn (text parts and PNG images in order), optionally after a system one."""
    msg = generate_pb2.GenerateRequest()
    if system:
        msg.messages.add(role="system").content.add(text=system)
    turn = msg.messages.add(role="user")
    for part in parts:
        if isinstance(part, bytes):
            turn.content.add(image=generate_pb2.MediaItem(encoded=part))
        else:
            turn.content.add(text=part)
    msg.sampling.max_tokens = MAX_NEW
    msg.sampling.ignore_eos = True  # random weights: compare MAX_NEW ids, never stop early
    return msg


def hf_messages(msg: generate_pb2.GenerateRequest) -> list[dict]:
    return [{"role": m.role, "content": [
        {"type": "image"} if p.HasField("image") else {"type": "text", "text": p.text}
        for p in m.content]} for m in msg.messages]


def reference_ids(model: torch.nn.Module, model_dir: Path,
                  msg: generate_pb2.GenerateRequest) -> list[int]:
    """transformers' greedy ids for ``msg``, processed as its own processor would."""
    tokenizer = reference_tokenizer(qwen2_vl_dir())
    text = tokenizer.apply_chat_template(hf_messages(msg), add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pictures = [Image.open(io.BytesIO(p.image.encoded)).convert("RGB")
                for m in msg.messages for p in m.content if p.HasField("image")]
    inputs: dict[str, torch.Tensor] = {}
    if pictures:
        processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        batch = processor(images=pictures, return_tensors="pt")
        inputs = {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}
        counts = iter((batch["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for i in ids for t in ([i] * next(counts) if i == IMAGE_PAD else [i])]
    input_ids = torch.tensor([ids])
    inputs.update(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if pictures:
        inputs["mm_token_type_ids"] = (input_ids == IMAGE_PAD).int()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def served(cell: Cell, msg: generate_pb2.GenerateRequest,
           ) -> tuple[list[int], str, generate_pb2.GenerateResponse]:
    ids, text, last = cell.stream(msg)
    assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
    return ids, text, last


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
       ) -> Iterator[tuple[str, Path, torch.nn.Module]]:
    kind = request.param
    model = reference(kind, vocab_size=QWEN_VOCAB)
    model_dir = vl_model_dir(model, tmp_path_factory.mktemp(kind) / "model")
    yield kind, model_dir, model


def test_chat_with_images_matches_transformers(vl: tuple[str, Path, torch.nn.Module],
                                               tmp_path: Path) -> None:
    kind, model_dir, model = vl
    cat, dog = png(1, 112, 84), png(2, 40, 200)  # a wide and a very tall image
    first = chat(cat, "What is in this picture? Answer in one word, please.",
                 system="You are a careful assistant.")
    both = chat("Compare ", cat, " with ", dog, ".")
    expected_first = reference_ids(model, model_dir, first)
    expected_both = reference_ids(model, model_dir, both)
    assert len(set(expected_first)) > 1, "the reference must not degenerate"
    with running_cell(tmp_path / "cold", "--model", str(model_dir)) as cell:
        ids, text, last = served(cell, first)
        assert ids == expected_first, kind
        tokenizer = reference_tokenizer(qwen2_vl_dir())
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
        # The same turn again: the prompt comes from the prefix cache, the image from the
        # processor cache, and no encoder runs (the seed scenario on a real model).
        again, _, last2 = served(cell, first)
        assert again == expected_first
        u1, u2 = last.usage, last2.usage
        assert (u1.mm_items, u1.mm_cache_hits, u1.encoder_runs, u1.cached_prompt_tokens) == (
            1, 0, 1, 0)
        assert u2.mm_cache_hits == 1 and u2.encoder_runs == 0
        assert u2.cached_prompt_tokens >= u2.prompt_tokens - 16
        assert served(cell, both)[0] == expected_both
        # Batched: several turns at once give each one's ids.
        results: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i, m=m: results.__setitem__(
            i, served(cell, m)[0])) for i, m in enumerate([first, both, first, both])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {0: expected_first, 1: expected_both, 2: expected_first,
                           3: expected_both}
        stats = cell.stats()
        assert stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    # Chunked prefill: 16 tokens a step cuts through the images' placeholder runs.
    with running_cell(tmp_path / "chunked", "--model", str(model_dir),
                      "--max-num-batched-tokens", "64", "--encoder-cache-size", "256") as cell:
        assert served(cell, both)[0] == expected_both


def test_prompt_form_uses_the_model_image_marker(vl: tuple[str, Path, torch.nn.Module],
                                                 tmp_path: Path) -> None:
    """The plain prompt form with Qwen's own marker gives what the chat form gives when the
    prompt is the rendered template."""
    _, model_dir, model = vl
    msg = chat(png(3), "Describe it.")
    tokenizer = reference_tokenizer(qwen2_vl_dir())
    rendered = tokenizer.apply_chat_template(hf_messages(msg), add_generation_prompt=True,
                                             tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in rendered
    plain = generate_pb2.GenerateRequest(prompt=rendered)
    plain.images.add(encoded=png(3))
    plain.sampling.CopyFrom(msg.sampling)
    with running_cell(tmp_path, "--model", str(model_dir)) as cell:
        assert served(cell, plain)[0] == served(cell, msg)[0] == reference_ids(
            model, model_dir, msg)


def test_bad_requests_on_a_real_model(vl: tuple[str, Path, torch.nn.Module],
                                      tmp_path: Path) -> None:
    import grpc

    _, model_dir, _ = vl
    both = chat("Hi")
    both.prompt = "Hi"
    neither = generate_pb2.GenerateRequest()
    images_with_messages = chat("Hi")
    images_with_messages.images.add(encoded=png(1))
    marker_mismatch = generate_pb2.GenerateRequest(prompt="<|image_pad|> twice <|image_pad|>")
    marker_mismatch.images.add(encoded=png(1))
    with running_cell(tmp_path, "--model", str(model_dir)) as cell:
        for msg, words in [(both, "more than one of prompt"),
                           (neither, "neither a prompt nor messages"),
                           (images_with_messages, "content"),
                           (marker_mismatch, "placeholders")]:
            with pytest.raises(grpc.RpcError) as info:
                list(cell.stub.Generate(msg, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in info.value.details(), info.value.details()
        stats = cell.stats()
        assert stats.shm_unacked_refs == 0 and stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.slow
def test_smollm2_answers_like_transformers(tmp_path: Path) -> None:
    """Real trained weights (SmolLM2-135M-Instruct): the same greedy answers as
    transformers for chat prompts, through ``tandem serve``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    questions = ["What is the capital of France?", "Name three primary colours.",
                 "Write a haiku about the sea."]
    with running_cell(tmp_path, "--model", str(model_dir)) as cell:
        for question in questions:
            msg = generate_pb2.GenerateRequest()
            msg.messages.add(role="user").content.add(text=question)
            msg.sampling.max_tokens = 24
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
            expected = out[0, len(ids):].tolist()
            got: list[int] = []
            text = ""
            for part in cell.stub.Generate(msg, timeout=120):
                got.extend(part.token_ids)
                text += part.text
            eos = set(tokenizer.convert_tokens_to_ids(["<|im_end|>"]))
            # transformers stops after the end-of-turn token; Tandem includes it too.
            assert got == expected, (question, tokenizer.decode(got), tokenizer.decode(expected))
            if question.startswith("What is the capital"):
                assert "Paris" in text
            assert not (eos & set(got[:-1]))
