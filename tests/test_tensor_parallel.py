"""Tensor parallelism: the sharded model against the whole one, and TP=2 against TP=1 in a
real cell.

The unit test runs two gloo ranks (torch.multiprocessing spawn) through the StepRunner with
a two-image prompt, chunked prefill and a prefix-cache hit; their logits must match the
unsharded model's within LOGITS_ATOL (float32: the shards only change summation order) and
their greedy tokens must be equal. A step that one rank rejects must be rejected by both,
leaving them paired for the next. The end-to-end test compares ``tandem serve --workers 2
--tensor-parallel-size 2`` with a one-worker cell on the same requests.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from tandem.errors import FailedPrecondition, InvalidInput
from tandem.v1 import generate_pb2
from tandem_testing.cells import png, request, running_cell
from tandem_testing.scripted import (
    ScriptedRequest,
    ScriptedScheduler,
    synthetic_image,
    synthetic_prompt,
)
from worker_svc.checkpoint import build_model
from worker_svc.config import WorkerConfig
from worker_svc.model import Transformer
from worker_svc.model_config import PRESETS
from worker_svc.runner import StepRunner
from worker_svc.step import StepInput
from worker_svc.tensor_parallel import (
    GroupLost,
    TensorParallelGroup,
    check_divisible,
    rank_device,
    shard_model,
)

LOGITS_ATOL = 1e-4
BLOCK_SIZE = 4
MAX_NEW = 6
TP = 2
PRESET_NAMES = ("tiny", "tiny-mrope")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(preset: str) -> list[ScriptedRequest]:
    """Cold with chunks that cut through the images, then a prefix hit on the same prompt."""
    config = PRESETS[preset]
    images = [("img-a", synthetic_image(config, 4, 6, seed=1)),
              ("img-b", synthetic_image(config, 6, 4, seed=2))]
    tokens, features = synthetic_prompt(config, ["Look: ", " and ", " -- same?"], images)
    return [ScriptedRequest("cold", tokens, features, MAX_NEW, chunk_size=7),
            ScriptedRequest("warm", tokens, features, MAX_NEW)]


def _generate(model: Transformer, runner: StepRunner, preset: str,
              ) -> tuple[list[list[int]], torch.Tensor]:
    """Token ids of each request and every logits row the model produced."""
    captured: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: captured.append(out))
    sched = ScriptedScheduler(BLOCK_SIZE)
    cold, warm = _requests(preset)
    sched.run(runner.step, [cold])
    hit = (len(warm.token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    warm.prefix_blocks, warm.num_computed_tokens = cold.block_ids[:hit // BLOCK_SIZE], hit
    sched.run(runner.step, [warm])
    runner.step(sched.flush())
    hook.remove()
    runner.check_invariants()
    return [cold.output, warm.output], torch.cat([c for c in captured if c.shape[0]])


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    """One TP rank, for each preset: shard, pair up, survive a step only this rank
    rejects, then generate; at the end rank 1 dies and rank 0 must see GroupLost."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=TP, timeout=datetime.timedelta(seconds=60))
    try:
        group = TensorParallelGroup(dist.group.WORLD, TP, torch.device("cpu"))
        for preset in PRESET_NAMES:
            model = build_model(PRESETS[preset], torch.device("cpu"), torch.float32)
            shard_model(model, rank, TP)
            group.all_reduce_outputs(model)
            model.setup_caches(num_blocks=128, block_size=BLOCK_SIZE)
            runner = StepRunner(model, receiver=None, tp=group)
            bad = StepInput(0, num_scheduled_tokens={"nobody": 1} if rank == 1 else {})
            try:
                runner.step(bad)
                rejected = ""
            except (InvalidInput, FailedPrecondition) as exc:
                rejected = exc.reason or ""
            ids, logits = _generate(model, runner, preset)
            torch.save({"rejected": rejected, "ids": ids, "logits": logits},
                       Path(out_dir) / f"{preset}-rank{rank}.pt")
        if rank == 1:
            os._exit(0)  # dies without leaving the group
        with pytest.raises(GroupLost):
            group.all_ok(True)
        (Path(out_dir) / "lost").touch()
    finally:
        dist.destroy_process_group()


def test_sharded_model_matches_full(tmp_path: Path) -> None:
    torch_mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=TP)
    for preset in PRESET_NAMES:
        full = build_model(PRESETS[preset], torch.device("cpu"), torch.float32)
        full.setup_caches(num_blocks=128, block_size=BLOCK_SIZE)
        ref_ids, ref_logits = _generate(full, StepRunner(full, receiver=None), preset)
        assert len(set(ref_ids[0])) > 1, "degenerate reference: the test would prove little"
        assert ref_ids[0] == ref_ids[1]
        results = [torch.load(tmp_path / f"{preset}-rank{r}.pt") for r in range(TP)]
        assert [r["rejected"] for r in results] == ["PEER_REJECTED_STEP", "SCHEDULED_MISMATCH"]
        for r in results:
            assert r["ids"] == ref_ids
            torch.testing.assert_close(r["logits"], ref_logits, atol=LOGITS_ATOL, rtol=0)
        # The ranks' logits are the same bits: that is what lets every rank sample alone.
        assert torch.equal(results[0]["logits"], results[1]["logits"])
    assert (tmp_path / "lost").exists(), "rank 0 saw its peer die as GroupLost"


def test_shards_partition_the_layers() -> None:
    full = build_model(PRESETS["tiny"], torch.device("cpu"), torch.float32)
    shards = [copy.deepcopy(full) for _ in range(TP)]
    for rank, shard in enumerate(shards):
        shard_model(shard, rank, TP)
    a0, f0 = shards[0].layers[0].attention, shards[0].layers[0].feed_forward
    head_dim = full.config.head_dim
    assert (a0.n_heads, a0.n_kv_heads, a0.wqkv.out_features, a0.wo.in_features) == (
        2, 1, (2 + 2 * 1) * head_dim, 2 * head_dim)
    assert f0.w13.weight.shape == (2 * 352 // TP, 128) and f0.w2.in_features == 352 // TP
    whole = full.layers[1]
    q, k, v = whole.attention.wqkv.weight.split([128, 64, 64])
    parts = [s.layers[1].attention.wqkv.weight.split([64, 32, 32]) for s in shards]
    for i, w in enumerate((q, k, v)):
        assert torch.equal(torch.cat([p[i] for p in parts]), w)
    gate, up = whole.feed_forward.w13.weight.chunk(2)
    parts = [s.layers[1].feed_forward.w13.weight.chunk(2) for s in shards]
    for i, w in enumerate((gate, up)):
        assert torch.equal(torch.cat([p[i] for p in parts]), w)
    assert torch.equal(torch.cat([s.layers[1].feed_forward.w2.weight for s in shards], 1),
                       whole.feed_forward.w2.weight)
    assert torch.equal(torch.cat([s.layers[1].attention.wo.weight for s in shards], 1),
                       whole.attention.wo.weight)
    assert torch.equal(shards[1].output.weight, full.output.weight), "the head is replicated"


def test_sizes_that_do_not_divide_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="n_heads=4"):
        check_divisible(PRESETS["tiny"], 3)
    with pytest.raises(InvalidInput, match="n_kv_heads=2"):
        check_divisible(PRESETS["tiny"], 4)
    with pytest.raises(ValueError, match="not a multiple"):
        WorkerConfig(shm_dir=str(tmp_path), world_size=3, tensor_parallel_size=2)
    assert WorkerConfig(shm_dir=str(tmp_path), rank=3, world_size=4,
                        tensor_parallel_size=2).tensor_parallel_size == 2
    cpu = torch.device("cpu")
    assert rank_device(cpu, 1, 2) == cpu


PROMPT = "Describe this picture: <image> in a few words, please, and be brief about it."


def _serve_twice(tmp: Path, *flags: str) -> tuple[list[list[int]], int, int, list[int]]:
    """The same image and prompt twice; (ids of each, cached tokens of the 2nd, unacked,
    ids of a sampled request under a JSON schema: every rank must apply its masks, or the
    ranks' next inputs differ)."""
    constrained = request("JSON: ", max_tokens=40, temperature=1.0, seed=5,
                          json_schema=json.dumps({"type": "array", "items": {
                              "type": "integer"}, "maxItems": 3}))
    with running_cell(tmp, "--enable-prefix-caching", *flags) as cell:
        runs = [cell.generate(PROMPT, [png(1)], max_tokens=10) for _ in range(2)]
        json_ids, text, last = cell.stream(constrained)
        unacked = cell.stats().shm_unacked_refs
    assert cell.proc.returncode == 0
    assert last.finish_reason == generate_pb2.FINISH_REASON_STOP and json.loads(text) != ""
    return ([ids for ids, _, _ in runs], runs[1][2].usage.cached_prompt_tokens, unacked,
            json_ids)


def test_tp2_cell_matches_tp1(tmp_path: Path) -> None:
    ref, ref_cached, _, ref_json = _serve_twice(tmp_path / "tp1")
    ids, cached, unacked, json_ids = _serve_twice(tmp_path / "tp2", "--workers", "2",
                                                  "--tensor-parallel-size", "2")
    assert ids == ref and ids[0] == ids[1] and len(set(ids[0])) > 1
    assert json_ids == ref_json and len(json_ids) > 3, "every rank applies the token masks"
    assert cached == ref_cached > 0, "the second request hits the prefix cache"
    assert unacked == 0, "both ranks acknowledged every SHM reference"
