"""Hugging Face safetensors weights -> a ``Transformer`` built on ``meta``, converted at load.

Files: ``model.safetensors``, or shards listed by ``model.safetensors.index.json``; any of
bf16/fp16/fp32. Each tensor is read straight to the serving device, cast to the serving
dtype there, converted, and assigned as the parameter: the weights exist once, on the
device (no host copy of the model, one tensor at a time in flight).

What the conversion does, once, so that ``forward`` never branches on the format:

* names: both prefixes found in the wild are accepted (``model.layers.*`` or
  ``model.language_model.layers.*``; ``visual.*`` or ``model.visual.*``). The decoder's
  names map to Tandem's (``q/k/v_proj`` -> ``wqkv``, ``gate/up_proj`` -> ``w13``,
  ``down_proj`` -> ``w2``,
  ``embed_tokens`` -> ``tok_embeddings``, ``lm_head`` -> ``output``...); the vision
  towers keep the checkpoint's names (``qwen_vision.py``).
* q/k/v are fused into one ``wqkv``, gate/up into one ``w13`` (weights and biases; the
  parts in ``FUSED`` order, rows stacked).
* rotary layout: checkpoints rotate half-vectors (pair i = dims i and i + D/2); Tandem
  rotates interleaved pairs (2i, 2i+1). Rows of every q and k projection (and their biases)
  are permuted per head so that pair i lands on rows 2i, 2i+1.
  NOTE: switching Tandem to rotate-half was rejected: the built-in models (and every
  exported file) would change their outputs, or two rotary code paths would exist.
  The permutation is exact (a reordering of rows), so scores q.k are unchanged.
* the Conv3d patch embedding (E, C, T, P, P) is viewed as a Linear (E, C*T*P*P).
* ``lm_head.weight`` may be absent when ``tie_word_embeddings`` is set (the head is the
  embedding matrix) and is ignored then.

Every refusal names the file and the checkpoint key: a missing tensor, an unexpected one,
a wrong shape (with the vocabulary spelled out when the embedding rows disagree with
``vocab_size``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from tandem.errors import InvalidInput
from worker_svc.model import Transformer
from worker_svc.model_config import CONFIG_FILE, WEIGHTS_FILE, ModelConfig

INDEX_FILE = "model.safetensors.index.json"
# Old Llama checkpoints carry the rotary frequencies as a tensor; Tandem computes them.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# Decoder names: checkpoint (after the prefixes) <-> Tandem. {i} is a layer, {w} weight or
# bias, {p} the part of a fused projection.
_DECODER = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attention_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.ffn_norm.weight"),
    ("model.layers.{i}.self_attn.{p}_proj.{w}", "layers.{i}.attention.wqkv.{w}"),
    ("model.layers.{i}.self_attn.o_proj.{w}", "layers.{i}.attention.wo.{w}"),
    ("model.layers.{i}.mlp.{p}_proj.{w}", "layers.{i}.feed_forward.w13.{w}"),
    ("model.layers.{i}.mlp.down_proj.{w}", "layers.{i}.feed_forward.w2.{w}"),
]
# The parts of each fused projection, in the order their rows are stacked.
FUSED = {"wqkv": ("q", "k", "v"), "w13": ("gate", "up")}
_GROUPS = {"{i}": r"(?P<i>\d+)", "{w}": "(?P<w>weight|bias)",
           "{p}": "(?P<p>" + "|".join(p for parts in FUSED.values() for p in parts) + ")"}


def _pattern(template: str) -> re.Pattern[str]:
    regex = re.escape(template)
    for field, group in _GROUPS.items():
        regex = regex.replace(re.escape(field), group)
    return re.compile(regex)


_FORWARD = [(_pattern(hf), tandem) for hf, tandem in _DECODER]
_BACKWARD = [(_pattern(tandem), hf) for hf, tandem in _DECODER]
_VISION_QKV = re.compile(r"visual\.blocks\.\d+\.attn\.qkv\.(weight|bias)")
_PATCH_EMBED = "visual.patch_embed.proj.weight"


def load_hf_weights(model: Transformer, model_dir: Path, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Assign every parameter of ``model`` (on ``meta``) from the checkpoint in ``model_dir``.

    Names and shapes are checked from the files' headers before any tensor is read, so a
    bad checkpoint fails in milliseconds, however large (:func:`check_hf_weights`)."""
    config = model.config
    plan = _checked_plan(config, model_dir, _expected(model))
    state: dict[str, Tensor] = {}
    pending: dict[str, dict[str, Tensor]] = {}  # fused name -> its parts read so far
    for path, entries in plan.items():
        with _open(path, device) as f:
            for key, name, part in entries:
                tensor = _convert(name, _read(f, key, f"{path}: tensor {key!r}").to(dtype),
                                  config)
                if part is None:
                    state[name] = tensor
                    continue
                parts = pending.setdefault(name, {})
                parts[part] = rotate_half_to_interleaved(tensor, config.head_dim) if part in (
                    "q", "k") else tensor
                order = _parts(name)
                if len(parts) == len(order):
                    state[name] = torch.cat([parts.pop(p) for p in order])  # rows stacked
                    del pending[name]
    if config.tie_word_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight


def check_hf_weights(config: ModelConfig, model_dir: Path) -> None:
    """Every tensor the config needs is in the checkpoint with its shape, nothing else is:
    read from the safetensors headers only (a start-up check before any process loads)."""
    with torch.device("meta"):
        model = Transformer(config)
    _checked_plan(config, model_dir, _expected(model))


def _expected(model: Transformer) -> dict[str, tuple[int, ...]]:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("output.weight")
    return expected


_Plan = dict[Path, list[tuple[str, str, str | None]]]  # file -> (key, Tandem name, fused part)


def _checked_plan(config: ModelConfig, model_dir: Path,
                  expected: dict[str, tuple[int, ...]]) -> _Plan:
    """What to read from which file, after checking names and converted shapes."""
    plan: _Plan = {}
    shapes: dict[str, tuple[int, ...]] = {}
    source: dict[str, str] = {}  # Tandem name -> "file: checkpoint key", for messages
    fused: dict[str, dict[str, tuple[int, ...]]] = {}  # fused name -> its parts' shapes
    present: set[str] = set()  # checkpoint keys, without their name prefixes
    for path, keys in _weight_files(model_dir).items():
        with _open(path, torch.device("cpu")) as f:
            for key in keys:
                name, part = _tandem_name(key)
                present.add(_unprefixed(key))
                if name is None or (name == "output.weight" and config.tie_word_embeddings):
                    continue
                where = f"{path}: tensor {key!r}"
                if name not in expected:
                    raise InvalidInput(f"{where} is not part of a {config.model_type} model "
                                       "with this config.json", reason="BAD_CHECKPOINT")
                shape = _header_shape(f, key, where)
                plan.setdefault(path, []).append((key, name, part))
                source[name] = where
                if part is None:
                    shapes[name] = _converted_shape(name, shape)
                    continue
                parts = fused.setdefault(name, {})
                parts[part] = _check_part(shape, part, config, expected[name][1:], where)
                order = _parts(name)
                if len(parts) == len(order):
                    rows = sum(parts[p][0] for p in order)
                    shapes[name] = (rows, *parts[order[0]][1:])
    _check(shapes, expected, source, present, model_dir, config)
    return plan


def _header_shape(f: Any, key: str, where: str) -> tuple[int, ...]:
    try:
        return tuple(f.get_slice(key).get_shape())
    except SafetensorError as exc:  # an index naming a tensor its shard lacks
        raise InvalidInput(f"{where}: not readable ({exc})", reason="BAD_CHECKPOINT") from exc


def _weight_files(model_dir: Path) -> dict[Path, list[str]]:
    """Checkpoint keys of each safetensors file, from the single file or the shard index."""
    single, index = model_dir / WEIGHTS_FILE, model_dir / INDEX_FILE
    if single.is_file():
        with _open(single, torch.device("cpu")) as f:
            return {single: list(f.keys())}
    if not index.is_file():
        raise InvalidInput(f"{model_dir}: no {WEIGHTS_FILE} or {INDEX_FILE} next to its "
                           f"{CONFIG_FILE}", reason="BAD_CHECKPOINT")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[Path, list[str]] = {}
        for key, file in weight_map.items():
            files.setdefault(model_dir / file, []).append(key)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInput(f"{index}: no readable 'weight_map' ({exc})",
                           reason="BAD_CHECKPOINT") from exc
    for file in files:
        if not file.is_file():
            raise InvalidInput(f"{index}: shard {file.name!r} is missing",
                               reason="BAD_CHECKPOINT")
    return files


def _open(path: Path, device: torch.device) -> Any:  # safetensors' handle has no type
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except (SafetensorError, OSError) as exc:
        raise InvalidInput(f"{path}: not a readable safetensors file ({exc})",
                           reason="BAD_CHECKPOINT") from exc


def _read(f: Any, key: str, where: str) -> Tensor:
    """One tensor, on the device the file was opened for."""
    try:
        return f.get_tensor(key)
    except SafetensorError as exc:  # an index naming a tensor its shard lacks
        raise InvalidInput(f"{where}: not readable ({exc})", reason="BAD_CHECKPOINT") from exc


def _unprefixed(key: str) -> str:
    for old, new in _PREFIXES:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _tandem_name(key: str) -> tuple[str | None, str | None]:
    """(Tandem parameter name, part of a fused projection or None); (None, None) for
    ignored tensors.

    Unknown names (``self_attn.up_proj`` among them) come back unchanged so that the
    caller refuses them by name."""
    if _IGNORED.match(key):
        return None, None
    key = _unprefixed(key)
    for pattern, tandem in _FORWARD:
        m = pattern.fullmatch(key)
        if m:
            name, part = tandem.format(**m.groupdict()), m.groupdict().get("p")
            if part is None or part in _parts(name):
                return name, part
    return key, None


def _parts(name: str) -> tuple[str, ...]:
    """The parts a fused parameter is made of (``layers.0.attention.wqkv.weight``: q, k, v)."""
    return FUSED[name.split(".")[-2]]


def checkpoint_names(name: str) -> list[str]:
    """The checkpoint keys that make Tandem's parameter ``name`` (q, k, v for ``wqkv``)."""
    for pattern, hf in _BACKWARD:
        m = pattern.fullmatch(name)
        if m:
            return [hf.format(**m.groupdict(), p=p)
                    for p in (_parts(name) if "{p}" in hf else ("_",))]
    return [name]


def rotate_half_to_interleaved(t: Tensor, head_dim: int) -> Tensor:
    """Permute the rows of a q or k projection (weight (H*D, in) or bias (H*D,)) so that the
    rotary pair (i, i + D/2) of every head becomes rows (2i, 2i+1)."""
    rest = t.shape[1:]
    heads = t.shape[0] // head_dim
    t = t.reshape(heads, 2, head_dim // 2, *rest)  # (H, 2, D/2, ...): halves of each head
    return t.transpose(1, 2).reshape(heads * head_dim, *rest)  # (H*D, ...), pairs interleaved


def _convert(name: str, t: Tensor, config: ModelConfig) -> Tensor:
    """Layout changes of tensors that are not fused (the vision tower's)."""
    if name == _PATCH_EMBED and t.dim() == 5:
        return t.reshape(t.shape[0], -1)  # (E, C, T, P, P) -> (E, C*T*P*P)
    if _VISION_QKV.fullmatch(name) and t.shape[0] == 3 * config.vision_dim:  # else _check
        q, k, v = t.chunk(3)  # (3*dim, ...) -> 3 x (dim, ...)
        d = config.vision_head_dim
        return torch.cat([rotate_half_to_interleaved(q, d), rotate_half_to_interleaved(k, d), v])
    return t


def _converted_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape :func:`_convert` gives a tensor of ``shape`` (only the patch embedding's
    changes)."""
    if name == _PATCH_EMBED and len(shape) == 5:
        return (shape[0], shape[1] * shape[2] * shape[3] * shape[4])
    return shape


def _check_part(shape: tuple[int, ...], part: str, config: ModelConfig,
                columns: tuple[int, ...], where: str) -> tuple[int, ...]:
    """A part's shape, once it has the fused parameter's ``columns`` and its rows match
    the config: the heads for a q, k or v projection, ``intermediate_size`` for gate and
    up."""
    if shape[1:] != columns:
        raise InvalidInput(f"{where} has shape {shape}, expected {columns} after its rows "
                           f"from {CONFIG_FILE}", reason="BAD_CHECKPOINT")
    if part in ("gate", "up"):
        if shape[0] != config.intermediate_size:
            raise InvalidInput(f"{where} has shape {shape}; intermediate_size "
                               f"{config.intermediate_size} needs as many rows",
                               reason="BAD_CHECKPOINT")
        return shape
    heads = config.n_heads if part == "q" else config.n_kv_heads
    rows = heads * config.head_dim
    if shape[0] != rows:
        raise InvalidInput(f"{where} has shape {shape}; {heads} heads of "
                           f"{config.head_dim} need {rows} rows", reason="BAD_CHECKPOINT")
    return shape


def _check(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
           source: dict[str, str], present: set[str], model_dir: Path,
           config: ModelConfig) -> None:
    """Every expected parameter present with its shape, or an error naming the tensor."""
    for name, shape in expected.items():
        if name not in shapes:
            missing = [k for k in checkpoint_names(name) if k not in present]
            raise InvalidInput(f"{model_dir}: the checkpoint has no tensor {missing[0]!r} "
                               f"(none under either name prefix), which {CONFIG_FILE} needs",
                               reason="BAD_CHECKPOINT")
        got = shapes[name]
        if got == shape:
            continue
        if name in ("tok_embeddings.weight", "output.weight") and got[1:] == shape[1:]:
            raise InvalidInput(f"{source[name]} has {got[0]} rows but {CONFIG_FILE} says "
                               f"vocab_size {config.vocab_size}", reason="BAD_CHECKPOINT")
        raise InvalidInput(f"{source[name]} has shape {got}, expected {shape} from "
                           f"{CONFIG_FILE}", reason="BAD_CHECKPOINT")
