"""Tensor parallelism across a cell's workers: the decoder split Megatron-style.

Each rank keeps a contiguous slice of every layer's attention heads (query heads and KV
heads alike, so each grouped-query group stays on one rank) and of the SwiGLU hidden
width. ``wqkv`` and ``w13`` keep their slice of each part's output rows (column-parallel),
``wo`` and ``w2`` their slice of input columns (row-parallel), and an all-reduce of the
row-parallel outputs gives every rank the full (T, dim) activations again: two
all-reduces per layer, attached as forward hooks so ``model.py`` keeps one code path.

Biases (Qwen2's q/k/v, Llama's optional attention and MLP ones) follow their weights'
rows on the column-parallel side; a row-parallel bias is added by rank 0 only (zero on the
others), so the all-reduced sum holds it once.

Replicated on every rank: embeddings, norms, the output head and the vision encoder
(the built-in one and the Qwen2-VL / Qwen2.5-VL towers: a few hundred million parameters
at most, run once per image, next to the decoder that runs every token). Because an all-reduce hands
every rank the same bits (gloo and NCCL reduce each element once and share the result),
every rank computes the same logits and samples the same tokens, so the ranks agree on
each request's tokens without sending them. NOTE: broadcasting rank 0's sampled tokens
instead was rejected: one more collective per step for a guarantee the sums already give.

Ranks of a cell: workers ``0..W-1`` form ``W / tp`` groups of ``tp`` consecutive ranks;
each group computes the same thing, and the scheduler takes worker 0's tokens.
"""

from __future__ import annotations

import datetime
import logging
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tandem.errors import InvalidInput, Unavailable
from worker_svc.config import WorkerConfig
from worker_svc.model import Transformer, TransformerBlock
from worker_svc.model_config import ModelConfig

log = logging.getLogger(__name__)

# Bounds the rendezvous (pods of a cell may start minutes apart) and every collective. gloo
# notices a dead peer at once (its socket closes); NCCL may only notice at this timeout, when
# its watchdog ends the process.
TIMEOUT = datetime.timedelta(seconds=600)


class GroupLost(Unavailable):
    """A collective failed: a peer rank died or hung, and this rank's group is unusable.

    The worker stops itself when it sees this (its supervisor restarts it), because a
    process group cannot be re-formed in place.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="TP_GROUP_LOST")


def check_divisible(config: ModelConfig, tp: int) -> None:
    """Refuse a split that would cut a head or a grouped-query group in two."""
    sizes = {"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
             "intermediate_size": config.intermediate_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise InvalidInput(f"tensor-parallel size {tp} does not divide {', '.join(bad)}",
                           reason="TP_SIZE_MISMATCH")


def _keep(linear: nn.Linear, dim: int, parts: list[Tensor],
          bias: Tensor | None = None) -> None:
    """Replace ``linear``'s weight by ``parts`` joined along ``dim`` (0 = rows = outputs),
    and its bias (if it has one) by ``bias``."""
    weight = torch.cat(parts, dim=dim).contiguous()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    linear.out_features, linear.in_features = weight.shape
    if linear.bias is not None:
        assert bias is not None and bias.shape == (linear.out_features,), "bias of the shard"
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)


def _column(linear: nn.Linear, tp_rank: int, tp: int, sizes: list[int]) -> None:
    """Keep this rank's slice of each output block of ``sizes`` rows (and bias entries)."""
    rows = [w.chunk(tp)[tp_rank] for w in linear.weight.split(sizes)]
    bias = None
    if linear.bias is not None:
        bias = torch.cat([b.chunk(tp)[tp_rank] for b in linear.bias.split(sizes)])
    _keep(linear, 0, rows, bias)


def _row(linear: nn.Linear, tp_rank: int, tp: int) -> None:
    """Keep this rank's slice of input columns; the bias stays whole on rank 0 only."""
    bias = None
    if linear.bias is not None:
        bias = linear.bias if tp_rank == 0 else torch.zeros_like(linear.bias)
    _keep(linear, 1, [linear.weight.chunk(tp, dim=1)[tp_rank]], bias)


def _blocks(model: Transformer) -> list[TransformerBlock]:
    blocks = list(model.layers)
    assert all(isinstance(b, TransformerBlock) for b in blocks)
    return cast(list[TransformerBlock], blocks)


def shard_model(model: Transformer, tp_rank: int, tp: int) -> None:
    """Keep rank ``tp_rank``'s slice of every decoder layer, in place.

    Call it on the CPU, before moving the model to its device, so the full weights never
    occupy the accelerator. ``model.config`` keeps the full sizes (the scheduler reads
    them); each layer's head counts become the rank's own.
    """
    check_divisible(model.config, tp)
    for layer in _blocks(model):
        a, f = layer.attention, layer.feed_forward
        _column(a.wqkv, tp_rank, tp, [a.q_size, a.kv_size, a.kv_size])  # head-major rows
        _row(a.wo, tp_rank, tp)
        a.n_heads, a.n_kv_heads = a.n_heads // tp, a.n_kv_heads // tp
        a.q_size, a.kv_size = a.q_size // tp, a.kv_size // tp
        _column(f.w13, tp_rank, tp, [f.w13.out_features // 2] * 2)  # gate rows, up rows
        _row(f.w2, tp_rank, tp)


class TensorParallelGroup:
    """This worker's tensor-parallel group: the collectives its steps run.

    Invariant (what keeps ranks paired up): every rank of a group runs the same sequence
    of collectives per step: one ``all_ok`` before anything changes, then two all-reduces
    per layer in each forward. A step one rank rejects is rejected by all of them.
    """

    def __init__(self, group: dist.ProcessGroup, tp: int, device: torch.device) -> None:
        self.group = group
        self.tp = tp
        self.device = device

    def all_ok(self, ok: bool) -> bool:
        """True when every rank of the group says ``ok`` (a MIN all-reduce of one flag)."""
        flag = torch.tensor([int(ok)], device=self.device)
        self._all_reduce(flag, dist.ReduceOp.MIN)
        return bool(flag.item())

    def all_reduce_outputs(self, model: Transformer) -> None:
        """Sum the row-parallel outputs (``wo``, ``w2``) over the group after each forward."""
        def hook(_module: nn.Module, _inputs: tuple[Tensor, ...], out: Tensor) -> None:
            self._all_reduce(out, dist.ReduceOp.SUM)

        for layer in _blocks(model):
            layer.attention.wo.register_forward_hook(hook)
            layer.feed_forward.w2.register_forward_hook(hook)

    def _all_reduce(self, t: Tensor, op: dist.ReduceOp.RedOpType) -> None:
        try:
            dist.all_reduce(t, op=op, group=self.group)
        except RuntimeError as exc:  # gloo and NCCL report a lost peer as RuntimeError
            raise GroupLost(f"tensor-parallel collective failed: {exc}") from exc


def rank_device(device: torch.device, rank: int, tp: int) -> torch.device:
    """Under tensor parallelism, ``cuda`` without an index means one GPU per rank when
    several are visible (local ``tandem serve``); a pod that sees one GPU uses it. NCCL
    refuses two ranks of a group on one GPU."""
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    if tp > 1 and device.index is None and count > 1:
        return torch.device("cuda", rank % count)
    return device


def join_group(config: WorkerConfig, device: torch.device) -> TensorParallelGroup:
    """Rendezvous with the cell's other workers at the configured master (blocks until all
    arrive) and return this worker's group: the whole world when every worker is one
    group, else its ``tensor_parallel_size`` consecutive ranks."""
    tp, world = config.tensor_parallel_size, config.world_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://{config.tp_master_addr}:{config.tp_master_port}",
        rank=config.rank, world_size=world, timeout=TIMEOUT)
    group = dist.group.WORLD
    if world > tp:
        group, _ = dist.new_subgroups(group_size=tp, timeout=TIMEOUT)
    assert group is not None
    log.info("worker %d joined tensor-parallel group %d as rank %d of %d (%s)", config.rank,
             config.rank // tp, config.rank % tp, tp, backend)
    return TensorParallelGroup(group, tp, device)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

