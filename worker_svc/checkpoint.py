"""Model weights: seeded built-in presets, Tandem's own files, and Hugging Face checkpoints.

A preset is built from its config's seed, so every worker of a cell (and the reference in
the tests) holds bit-identical weights without a file. ``export_model`` writes a preset as
``config.json`` + ``model.safetensors`` in Tandem's names and ``load_model`` reads it back;
a Hugging Face directory (``model_type`` in its config.json) is converted while it loads
(``hf_checkpoint.py``). Either way the modules are built on ``meta`` and the loaded tensors
are assigned, so the weights exist in memory once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tandem.errors import InvalidInput
from worker_svc.hf_checkpoint import check_hf_weights, load_hf_weights
from worker_svc.model import Transformer
from worker_svc.model_config import (
    CONFIG_FILE,
    PRESETS,
    TANDEM,
    WEIGHTS_FILE,
    ModelConfig,
    model_config_from_name,
)
from worker_svc.tensor_parallel import shard_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(spec: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; otherwise a torch device string."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def compute_dtype(device: torch.device, spec: str = "auto") -> torch.dtype:
    """The serving dtype: ``auto`` is bf16 on CUDA and fp32 elsewhere (CPUs lack fast bf16
    matmuls), whatever dtype the checkpoint files hold; otherwise one of ``DTYPES``."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in DTYPES:
        raise InvalidInput(f"dtype {spec!r} is not auto or one of {', '.join(DTYPES)}",
                           reason="BAD_DTYPE")
    return DTYPES[spec]


def build_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The model with its deterministic seeded weights (init runs on CPU, then moves)."""
    model = Transformer(config)
    model.init_weights(config.seed)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype,
               tp_rank: int = 0, tp: int = 1) -> Transformer:
    """A preset by name, or the model in a directory written by :func:`export_model`;
    with ``tp > 1`` only rank ``tp_rank``'s shard (``tensor_parallel.shard_model``).

    NOTE: a shard is cut from the whole model on the CPU, then moved: simple, and the CPU
    holds the full weights only while loading. Reading each rank's slice from the file
    (``safe_open(...).get_slice``) was rejected while the models fit a host's memory.
    """
    if tp > 1:
        model = load_model(name_or_path, torch.device("cpu"), dtype)
        shard_model(model, tp_rank, tp)
        return model.to(device)
    config = model_config_from_name(name_or_path)
    if name_or_path in PRESETS:
        return build_model(config, device, dtype)
    with torch.device("meta"):
        model = Transformer(config)
    if config.model_type != TANDEM:
        load_hf_weights(model, Path(name_or_path), device, dtype)
        return model.eval().requires_grad_(False)
    state = _fuse_gate_up(load_file(str(Path(name_or_path) / WEIGHTS_FILE), device=str(device)))
    try:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    except RuntimeError as exc:  # missing/unexpected keys or shape mismatches
        raise InvalidInput(f"weights in {name_or_path!r} do not match its config: {exc}",
                           reason="BAD_CHECKPOINT") from exc
    return model.eval().requires_grad_(False)


def _fuse_gate_up(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Files exported before the gate and up projections were fused name them ``w1`` and
    ``w3``: stack them into ``w13`` (gate rows, then up rows), as the model holds them."""
    for key in [k for k in state if ".feed_forward.w1." in k]:
        up = key.replace(".w1.", ".w3.")
        if up in state:
            state[key.replace(".w1.", ".w13.")] = torch.cat([state.pop(key), state.pop(up)])
    return state


def check_model(name_or_path: str) -> None:
    """Refuse, before any process loads it, a model that cannot load: its config.json
    (architecture, sizes) and, for a Hugging Face directory, every tensor's name and shape
    from the safetensors headers. Raises InvalidInput naming the file and the key."""
    config = model_config_from_name(name_or_path)
    if config.model_type != TANDEM:
        check_hf_weights(config, Path(name_or_path))
    elif name_or_path not in PRESETS and not (Path(name_or_path) / WEIGHTS_FILE).is_file():
        raise InvalidInput(f"{Path(name_or_path) / WEIGHTS_FILE}: file missing",
                           reason="BAD_CHECKPOINT")


def export_model(name: str, out_dir: str | Path) -> Path:
    """Write ``name`` (a preset or a Tandem model directory) as config.json +
    model.safetensors. A Hugging Face directory is served as it is, not exported."""
    if model_config_from_name(name).model_type != TANDEM:
        raise InvalidInput(f"{name!r} is a Hugging Face checkpoint: serve it as it is "
                           "(export-model writes the built-in models)", reason="BAD_EXPORT")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(name, torch.device("cpu"), torch.float32)
    (out / CONFIG_FILE).write_text(model.config.to_json() + "\n")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out
