"""TP=2 on CPU (two gloo ranks) gives TP=1's greedy tokens on tiny Hugging Face checkpoints.

Qwen2-VL (q/k/v biases split with their rows, the vision tower replicated) with a two-image
prompt in chunks that cut through the images, then a prefix hit; and Llama with attention
and MLP biases, whose row-parallel biases (o_proj, down_proj) rank 0 alone adds.
"""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from hf_checkpoints import images, reference, save, vl_prompt

from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler
from worker_svc.checkpoint import load_model
from worker_svc.runner import StepRunner
from worker_svc.tensor_parallel import TensorParallelGroup

TP = 2
BLOCK_SIZE = 4
MAX_NEW = 6
KINDS = ("qwen2_vl", "llama")


def _requests(kind: str) -> list[ScriptedRequest]:
    if kind == "llama":
        tokens, features = [5, 17, 33, 40, 41, 60, 61, 62, 63], []
    else:
        tokens, features = vl_prompt([[5, 17], [40], [60, 61, 62]],
                                     images([(224, 112), (60, 500)], seed=1))
    return [ScriptedRequest("cold", tokens, features, MAX_NEW, chunk_size=7),
            ScriptedRequest("warm", tokens, features, MAX_NEW)]


def _generate(model_dir: Path, kind: str, group: TensorParallelGroup | None,
              rank: int = 0) -> list[list[int]]:
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32, rank,
                       TP if group else 1)
    if group is not None:
        group.all_reduce_outputs(model)
    model.setup_caches(num_blocks=128, block_size=BLOCK_SIZE)
    runner, sched = StepRunner(model, receiver=None, tp=group), ScriptedScheduler(BLOCK_SIZE)
    cold, warm = _requests(kind)
    sched.run(runner.step, [cold])
    hit = (len(warm.token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    warm.prefix_blocks, warm.num_computed_tokens = cold.block_ids[:hit // BLOCK_SIZE], hit
    sched.run(runner.step, [warm])
    runner.step(sched.flush())
    runner.check_invariants()
    return [cold.output, warm.output]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=TP, timeout=datetime.timedelta(seconds=60))
    try:
        group = TensorParallelGroup(dist.group.WORLD, TP, torch.device("cpu"))
        for kind in KINDS:
            ids = _generate(Path(out_dir) / kind, kind, group, rank)
            torch.save(ids, Path(out_dir) / f"{kind}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tp2_matches_tp1_on_hf_checkpoints(tmp_path: Path) -> None:
    save(reference("qwen2_vl"), tmp_path / "qwen2_vl")
    save(reference("llama", attention_bias=True, mlp_bias=True), tmp_path / "llama")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch_mp.spawn(_rank_main, args=(port, str(tmp_path)), nprocs=TP)
    for kind in KINDS:
        want = _generate(tmp_path / kind, kind, None)
        assert len(set(want[0])) > 1 and want[0] == want[1]
        for rank in range(TP):
            assert torch.load(tmp_path / f"{kind}-rank{rank}.pt") == want, (kind, rank)
