"""Loading Hugging Face directories: the forms found in the wild, and one clear start-up
error (``InvalidInput`` naming the file and the key) for each bad model.

Forms: the current nested config.json (what transformers 5.x writes) and the older flat one,
both weight-name prefixes, a sharded index, bf16 files, and the special ids the scheduler
reads from ``Describe``'s model config JSON.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_checkpoints import BOS, EOS, IMAGE_PAD, VISION_END, VISION_START, reference, save
from safetensors.torch import load_file, save_file

from tandem.errors import InvalidInput
from worker_svc.checkpoint import check_model, compute_dtype, export_model, load_model
from worker_svc.config import WorkerConfig
from worker_svc.model_config import ModelConfig, model_config_from_name
from worker_svc.server import create_server, shutdown

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(reference("qwen2_vl"), tmp_path_factory.mktemp("qwen2_vl"))


def state(model_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    model = load_model(str(model_dir), CPU, dtype)
    assert all(not p.is_meta for p in model.parameters())
    return model.state_dict()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def rewrite_weights(model_dir: Path,
                    edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_nested_config_and_special_ids(qwen2_vl: Path) -> None:
    """transformers 5.x writes text_config/vision_config and rope_parameters; the ids the
    scheduler needs travel in the model config JSON (Describe)."""
    raw = json.loads((qwen2_vl / "config.json").read_text())
    assert "text_config" in raw and "rope_parameters" in raw["text_config"]
    gen = json.loads((qwen2_vl / "generation_config.json").read_text())
    gen["eos_token_id"] = [EOS, 7]  # a list, as instruct checkpoints ship it
    (qwen2_vl / "generation_config.json").write_text(json.dumps(gen))
    config = model_config_from_name(str(qwen2_vl))
    sent = json.loads(config.to_json())
    assert {k: sent[k] for k in ("model_type", "position_scheme", "patch_size", "merge_size",
                                 "temporal_patch_size", "in_channels", "bos_token_id",
                                 "eos_token_ids", "image_token_id", "vision_start_token_id",
                                 "vision_end_token_id", "mrope_section")} == {
        "model_type": "qwen2_vl", "position_scheme": "mrope", "patch_size": 14,
        "merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "bos_token_id": BOS,
        "eos_token_ids": [EOS, 7], "image_token_id": IMAGE_PAD,
        "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END,
        "mrope_section": [2, 3, 3]}
    assert ModelConfig.from_json(config.to_json()) == config
    assert config.patch_dim == 3 * 2 * 14 * 14


def test_flat_config_loads_the_same(qwen2_vl: Path, tmp_path: Path) -> None:
    """The older layout: decoder keys at the top, rope_scaling {type: mrope}, rope_theta at
    the top, in_chans in vision_config."""
    flat = copy(qwen2_vl, tmp_path / "flat")

    def flatten(raw: dict) -> None:
        text = raw.pop("text_config")
        rope = text.pop("rope_parameters")
        raw.update(text, model_type="qwen2_vl", rope_theta=rope["rope_theta"],
                   rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
        vision = raw["vision_config"]
        vision["in_chans"] = vision.pop("in_channels")
        del vision["rope_parameters"], vision["hidden_act"]  # quick_gelu: the default

    edit_config(flat, flatten)
    assert "hidden_size" in json.loads((flat / "config.json").read_text())
    assert model_config_from_name(str(flat)) == model_config_from_name(str(qwen2_vl))
    assert_same(state(flat), state(qwen2_vl))


def test_both_name_prefixes(qwen2_vl: Path, tmp_path: Path) -> None:
    """model.language_model.* / model.visual.* (transformers 4.5x's save) load like
    model.* / visual.*"""
    other = copy(qwen2_vl, tmp_path / "prefixed")

    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            if key.startswith("model."):
                tensors["model.language_model." + key[6:]] = tensors.pop(key)
            elif key.startswith("visual."):
                tensors["model." + key] = tensors.pop(key)

    rewrite_weights(other, rename)
    assert any(k.startswith("model.visual.") for k in load_file(other / "model.safetensors"))
    assert_same(state(other), state(qwen2_vl))


def test_sharded_index_and_bf16_files(tmp_path: Path) -> None:
    hf = reference("qwen2_5_vl")
    whole = save(hf, tmp_path / "whole")
    sharded = save(hf, tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (
        sharded / "model.safetensors").exists()
    assert_same(state(sharded), state(whole))

    bf16 = save(hf.to(torch.bfloat16), tmp_path / "bf16")
    assert next(iter(load_file(bf16 / "model.safetensors").values())).dtype == torch.bfloat16
    from_bf16 = state(bf16)
    rounded = {k: v.to(torch.bfloat16).float() for k, v in state(whole).items()}
    assert_same(from_bf16, rounded)  # conversion is a reordering: exact in any dtype
    served = state(whole, torch.bfloat16)  # fp32 files served in bf16
    assert all(v.dtype == torch.bfloat16 for v in served.values())


def test_dtype_setting(tmp_path: Path) -> None:
    assert compute_dtype(CPU) == torch.float32
    assert compute_dtype(torch.device("cuda")) == torch.bfloat16
    assert compute_dtype(CPU, "bfloat16") == torch.bfloat16
    with pytest.raises(InvalidInput, match="dtype 'fp8'"):
        compute_dtype(CPU, "fp8")
    with pytest.raises(ValueError, match="dtype"):
        WorkerConfig(shm_dir=str(tmp_path), dtype="half")


def test_bad_models_fail_with_the_file_and_key(qwen2_vl: Path, tmp_path: Path) -> None:
    def fails(model_dir: Path, *fragments: str) -> None:
        for attempt in (lambda: load_model(str(model_dir), CPU, torch.float32),
                        lambda: check_model(str(model_dir))):  # the start-up check too
            with pytest.raises(InvalidInput) as info:
                attempt()
            assert all(f in info.value.message for f in fragments), info.value.message

    no_config = copy(qwen2_vl, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    fails(no_config, str(no_config), "config.json")

    no_weights = copy(qwen2_vl, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    fails(no_weights, str(no_weights), "model.safetensors", "model.safetensors.index.json")

    sharded = save(reference("qwen2_vl"), tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    key, shard = next(iter(index["weight_map"].items()))
    (sharded / shard).unlink()
    fails(sharded, "model.safetensors.index.json", shard, "missing")
    other = index["weight_map"]["model.norm.weight"]
    assert other != shard
    index["weight_map"] = {k: other if f == shard else f  # tensors listed in a shard
                           for k, f in index["weight_map"].items()}  # that lacks them
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    fails(sharded, repr(key), "not readable")

    unknown = copy(qwen2_vl, tmp_path / "unknown")
    edit_config(unknown, lambda raw: raw.update(model_type="mamba"))
    fails(unknown, "config.json", "'model_type'", "mamba")

    def shrink_one(tensors: dict[str, torch.Tensor]) -> None:
        key = "model.layers.1.mlp.up_proj.weight"
        tensors[key] = tensors[key][:-1].contiguous()

    bad_shape = copy(qwen2_vl, tmp_path / "bad-shape")
    rewrite_weights(bad_shape, shrink_one)
    fails(bad_shape, "model.safetensors", "'model.layers.1.mlp.up_proj.weight'", "(127, 64)")

    missing = copy(qwen2_vl, tmp_path / "missing")
    rewrite_weights(missing, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias"))
    fails(missing, str(missing), "'model.layers.0.self_attn.k_proj.bias'")

    vocab = copy(qwen2_vl, tmp_path / "vocab")
    edit_config(vocab, lambda raw: raw["text_config"].update(vocab_size=512))
    fails(vocab, "'model.embed_tokens.weight'", "300 rows", "vocab_size 512")

    extra = copy(qwen2_vl, tmp_path / "extra")
    rewrite_weights(extra, lambda t: t.update({"model.layers.9.mlp.up_proj.weight":
                                               torch.zeros(1)}))
    fails(extra, "'model.layers.9.mlp.up_proj.weight'", "not part of a qwen2_vl model")

    rope = copy(qwen2_vl, tmp_path / "rope")
    edit_config(rope, lambda raw: raw["text_config"]["rope_parameters"].update(
        rope_type="yarn"))
    fails(rope, "'text_config.rope_parameters'", "yarn")

    with pytest.raises(InvalidInput, match="Hugging Face checkpoint"):
        export_model(str(qwen2_vl), tmp_path / "export")


def test_worker_with_a_bad_model_fails_at_start(qwen2_vl: Path, tmp_path: Path) -> None:
    """The worker process's warm-up (what ``serve`` ends with) raises the loader's error,
    and health never turned SERVING."""
    bad = copy(qwen2_vl, tmp_path / "bad")
    edit_config(bad, lambda raw: raw.update(model_type="mamba"))

    async def start() -> None:
        worker = await create_server(WorkerConfig(shm_dir=str(tmp_path / "shm"),
                                                  model=str(bad), device="cpu"))
        try:
            with pytest.raises(InvalidInput, match="'model_type' is 'mamba'"):
                await worker.warmup
            assert not worker.servicer.ready.is_set()
        finally:
            await shutdown(worker)

    asyncio.run(start())


def test_worker_warms_up_on_checkpoints(qwen2_vl: Path, tmp_path: Path) -> None:
    """The warm-up step uses the model's own ids (a VLM: BOS + one image placeholder through
    the Qwen tower; a text-only model: BOS alone) and Describe carries them."""
    llama = save(reference("llama"), tmp_path / "llama")

    async def start(model_dir: Path) -> dict[str, Any]:
        worker = await create_server(WorkerConfig(shm_dir=str(tmp_path / "shm"),
                                                  model=str(model_dir), device="cpu",
                                                  kv_cache_bytes=1 << 20))
        try:
            await worker.warmup
            assert worker.servicer.describe.dtype == "float32"
            return json.loads(worker.servicer.describe.model_config_json)
        finally:
            await shutdown(worker)

    vlm, text = asyncio.run(start(qwen2_vl)), asyncio.run(start(llama))
    assert (vlm["image_token_id"], vlm["bos_token_id"]) == (IMAGE_PAD, BOS)
    assert (text["model_type"], text["image_token_id"], text["eos_token_ids"]) == (
        "llama", None, [EOS])
