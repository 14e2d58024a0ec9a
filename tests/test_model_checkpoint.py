"""Weights on disk: export_model round-trips through load_model (built on meta, assigned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.errors import InvalidInput
from worker_svc.checkpoint import build_model, export_model, load_model
from worker_svc.model_config import PRESETS, ModelConfig, model_config_from_name


def test_export_then_load_round_trips(tmp_path: Path) -> None:
    out = export_model("tiny-mrope", tmp_path / "m")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors"}
    assert json.loads((out / "config.json").read_text())["position_scheme"] == "mrope"
    assert model_config_from_name(str(out)) == PRESETS["tiny-mrope"]

    cpu = torch.device("cpu")
    loaded = load_model(str(out), cpu, torch.float32)
    built = build_model(PRESETS["tiny-mrope"], cpu, torch.float32)
    want, got = built.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert all(not p.is_meta for p in loaded.parameters())

    pixels = torch.randn(16, loaded.config.patch_dim)
    loaded.setup_caches(4, 4)
    built.setup_caches(4, 4)
    assert torch.equal(loaded.encode_image(pixels, 4, 4), built.encode_image(pixels, 4, 4))


def test_weights_are_deterministic_and_seeded() -> None:
    cpu = torch.device("cpu")
    a = build_model(PRESETS["tiny"], cpu, torch.float32).state_dict()
    b = build_model(PRESETS["tiny"], cpu, torch.float32).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = build_model(ModelConfig(seed=99), cpu, torch.float32).state_dict()
    assert not torch.equal(a["output.weight"], other["output.weight"])


def test_unknown_model_and_mismatched_weights(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="neither a preset"):
        model_config_from_name("no-such-model")
    out = export_model("tiny", tmp_path / "m")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "n_layers": 5}))
    with pytest.raises(InvalidInput, match="do not match"):
        load_model(str(out), torch.device("cpu"), torch.float32)
    (out / "config.json").write_text(json.dumps({**config, "colour": "blue"}))
    with pytest.raises(InvalidInput, match="unknown model config keys"):
        model_config_from_name(str(out))


def test_a_file_with_separate_gate_and_up_loads_fused(tmp_path: Path) -> None:
    """Files exported before w13 name the gate and up projections w1 and w3."""
    out = export_model("tiny", tmp_path / "m")
    state = load_file(str(out / "model.safetensors"))
    for key in [k for k in state if ".w13." in k]:
        gate, up = state.pop(key).chunk(2)
        state[key.replace(".w13.", ".w1.")] = gate.contiguous()
        state[key.replace(".w13.", ".w3.")] = up.contiguous()
    save_file(state, str(out / "model.safetensors"))
    loaded = load_model(str(out), torch.device("cpu"), torch.float32).state_dict()
    built = build_model(PRESETS["tiny"], torch.device("cpu"), torch.float32).state_dict()
    assert loaded.keys() == built.keys()
    assert all(torch.equal(built[k], loaded[k]) for k in built)
