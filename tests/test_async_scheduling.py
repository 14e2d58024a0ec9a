"""Asynchronous scheduling changes when steps are sent, never which tokens come out.

The real engine (in this process, ``TANDEM_DEBUG_INVARIANTS=1``) drives a real worker
process with a KV pool small enough to preempt, once with ``async_scheduling`` on and once
off, through the same workload: concurrent text and image requests of different lengths
(batched, some preempted), one cancelled after its third token, one ended by a stop id, and
an image request repeated so its prefix (image included) is served from the cache. Greedy
outputs must be identical, every request must end exactly where it should (no token past
``max_tokens`` or a stop), and every SHM reference must be acknowledged once.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from engines import generate, idle, running_engine
from workers import running_worker

from scheduler_svc.engine import Engine
from scheduler_svc.request import Request
from tandem.v1 import generate_pb2
from tandem_testing.cells import png, request
from worker_svc.config import WorkerConfig
from worker_svc.model_config import PRESETS

BLOCK = 4
NUM_BLOCKS = 48  # about half of what the concurrent requests would need at their longest
IMAGE_PROMPT = "Look at <image> and tell me about it."
PROMPTS = [
    ("A short one.", [], 12),
    (IMAGE_PROMPT, [png(1, 56, 56)], 20),
    ("Tell me a long story about the sea and its ships.", [], 28),
    ("Two pictures: <image> and <image>, compare.", [png(2, 56, 56), png(3, 56, 56)], 16),
    ("Count from one to ten.", [], 24),
]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shm = tmp_path_factory.mktemp("shm")
    config = WorkerConfig(shm_dir=str(shm), block_size=BLOCK, kv_cache_bytes=NUM_BLOCKS
                          * PRESETS["tiny"].kv_bytes_per_block(BLOCK, 4))
    with running_worker(config):
        yield shm


def _engine(shm: Path, on: bool):
    return running_engine(shm, block_size=BLOCK, async_scheduling=on, encoder_cache_embeds=8,
                          min_pixels=56 * 56, max_pixels=56 * 56)


async def _cancelled_after(e: Engine, msg: generate_pb2.GenerateRequest, n: int) -> list[int]:
    """Stream ``msg`` and leave after ``n`` tokens (the client cancels)."""
    tokens: list[int] = []
    async with contextlib.aclosing(e.generate(msg)) as stream:
        async for _, out in stream:
            tokens += out.token_ids
            if len(tokens) >= n:
                break
    return tokens


async def _workload(e: Engine, stop_id: int | None) -> dict[str, object]:
    most_out = 0
    send = e.workers.send

    async def counting_send(msg):  # delegates: records how many steps were out at once
        nonlocal most_out
        sent = await send(msg)
        most_out = max(most_out, e.steps_out + 1)
        return sent

    e.workers.send = counting_send  # type: ignore[method-assign]
    msgs = [request(p, images, max_tokens=n, ignore_eos=True) for p, images, n in PROMPTS]
    cancelled = request("This one is cancelled early.", max_tokens=30, ignore_eos=True)
    stopper = request("Stop when you see it.", max_tokens=30, ignore_eos=True)
    if stop_id is not None:
        stopper.sampling.stop_token_ids.append(stop_id)
    finals: list[Request] = []

    async def run(msg: generate_pb2.GenerateRequest) -> list[int]:
        tokens: list[int] = []
        async for r, out in e.generate(msg):
            tokens += out.token_ids
            if out.finish_reason:
                finals.append(r)
        return tokens

    outs = await asyncio.gather(*(run(m) for m in msgs), _cancelled_after(e, cancelled, 3),
                                run(stopper))
    again: list[Request] = []
    repeat = await generate(e, msgs[1], on_first=again.append)
    await idle(e)
    assert e.errors == 0 and e.invariant_checks > 0
    assert e.cache_stats().shm_unacked_refs == 0 and e.ledger_stats().refs == 0
    e.check_invariants()
    return {"outputs": outs, "repeat": repeat, "cached": again[0].num_cached_tokens,
            "preemptions": e.counters.preemptions, "most_out": most_out,
            "reasons": sorted(r.finish_reason for r in finals)}


def test_greedy_outputs_are_the_same_with_async_scheduling_on_and_off(
        worker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DEBUG_INVARIANTS", "1")

    async def main() -> tuple[dict[str, object], dict[str, object]]:
        async with _engine(worker, False) as e:
            probe = await generate(e, request("Stop when you see it.", max_tokens=30,
                                              ignore_eos=True))
        stop_at = next(i for i in range(3, len(probe)) if probe[i] not in probe[:i])
        results = []
        for on in (False, True):
            async with _engine(worker, on) as e:
                results.append(await _workload(e, probe[stop_at]))
        return probe[:stop_at + 1], results

    stopped, (off, on) = asyncio.run(main())
    same = ("outputs", "repeat", "reasons")  # what the prefix cache kept may differ
    assert {k: on[k] for k in same} == {k: off[k] for k in same}
    outputs = off["outputs"]
    assert [len(o) for o in outputs[:len(PROMPTS)]] == [n for _, _, n in PROMPTS]
    assert len(outputs[len(PROMPTS)]) == 3, "the cancelled request streams nothing more"
    assert outputs[-1] == stopped, "the stop id ends the request, nothing after it"
    assert off["repeat"] == outputs[1]
    assert min(off["cached"], on["cached"]) >= 8, "the repeat's image comes from the prefix cache"
    assert off["preemptions"] > 0 and on["preemptions"] > 0, "the pool is too large to preempt"
    assert (off["most_out"], on["most_out"]) == (1, 2), "one step out at a time, or two"


def test_a_request_reusing_the_id_of_one_just_cancelled_gets_its_own_tokens(
        worker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves request r while a step out carries it and at once sends a new
    request with r's id (a retry). The new one's greedy output is a fresh request's, the
    engine's bookkeeping holds (checked after every step) and the worker refuses nothing;
    the retry goes out only once every step carrying the old r has been applied."""
    monkeypatch.setenv("TANDEM_DEBUG_INVARIANTS", "1")

    def msg(request_id: str) -> generate_pb2.GenerateRequest:
        m = request("Tell me a long story about the sea.", max_tokens=12, ignore_eos=True)
        m.request_id = request_id
        return m

    async def main() -> None:
        async with _engine(worker, True) as e:
            fresh = await generate(e, msg("fresh"))
            carrying: set[int] = set()  # steps sent that ran tokens of some r
            applied: set[int] = set()  # steps whose results came back
            early: list[int] = []  # steps admitting an r while an earlier r's step was out
            send, result = e.workers.send, e.workers.result

            async def recording_send(step):  # delegates, recording what goes out when
                if any(n.request_id == "r" for n in step.new_requests) and carrying - applied:
                    early.append(step.step_id)
                if "r" in step.num_scheduled_tokens:
                    carrying.add(step.step_id)
                return await send(step)

            async def recording_result(sent, timeout):
                out = await result(sent, timeout)
                applied.add(sent.step_id)
                return out

            e.workers.send = recording_send  # type: ignore[method-assign]
            e.workers.result = recording_result  # type: ignore[method-assign]
            for leave_after in (1, 2, 3, 5):
                await _cancelled_after(e, msg("r"), leave_after)
                assert carrying - applied, "the cancel must land while a step carries r"
                assert await generate(e, msg("r")) == fresh
            await idle(e)
            assert e.errors == 0 and e.worker_losses == 0 and e.invariant_checks > 0
            assert early == []
            e.check_invariants()

    asyncio.run(main())
