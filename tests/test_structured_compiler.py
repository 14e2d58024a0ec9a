"""The constraint compiler's bounds (tandem/structured.py), over the real llguidance backend,
and the workers' unpacking of token masks (worker_svc/sampler.py)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from tandem.errors import BadConstraint
from tandem.structured import (
    Constraint,
    ConstraintCompiler,
    Grammar,
    GuidanceBackend,
    allowed_masks,
    fill_together,
)
from tandem.text import ByteTokenizer
from tandem.text.byte_tokenizer import EOS_ID, VOCAB_SIZE
from worker_svc.sampler import refused_tokens


class CountingBackend:
    """The real backend, counting its compiles; ``gate`` (when set) holds each compile."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.inner = GuidanceBackend(ByteTokenizer())
        self.compiles: list[Constraint] = []
        self.gate = gate

    def compile(self, constraint: Constraint) -> Grammar:
        self.compiles.append(constraint)
        if self.gate is not None:
            self.gate.wait(10)
        return self.inner.compile(constraint)


def _allowed(mask: bytes) -> set[int]:
    bits = refused_tokens({0: mask}, 1, VOCAB_SIZE, torch.device("cpu"))[0]
    return set(torch.nonzero(~bits).flatten().tolist())


def test_same_spec_compiles_once_and_errors_are_cached() -> None:
    async def main() -> None:
        backend = CountingBackend()
        compiler = ConstraintCompiler(backend)
        spec = Constraint("regex", "[ab]{2}")
        started = await asyncio.gather(*(compiler.matcher(spec) for _ in range(8)))
        matchers = [m for m, _ in started]
        assert len(backend.compiles) == 1, "concurrent requests share one compile"
        uses = [use for _, use in started]
        assert [u.cache_hit for u in uses] == [False] + [True] * 7, "the first one compiled"
        assert all(u.kind == "regex" and u.compile_ms >= 0 for u in uses)
        assert (await compiler.matcher(spec))[1].cache_hit
        assert all(_allowed(m.allowed_mask()) == {ord("a"), ord("b")} for m in matchers)
        assert matchers[0].consume(ord("a")) and matchers[0].consume(ord("b"))
        assert matchers[0].is_stopped() and _allowed(matchers[1].allowed_mask()) == {
            ord("a"), ord("b")}, "each request advances its own matcher"
        bad = Constraint("json_schema", json.dumps({"type": "nonsense"}))
        for _ in range(2):
            with pytest.raises(BadConstraint, match="nonsense") as refused:
                await compiler.matcher(bad)
            assert refused.value.param == "response_format"
        assert len(backend.compiles) == 2, "a failed compile is cached too"
        await compiler.matcher(spec, salt="tenant-b")
        assert len(backend.compiles) == 3, "tenants (cache salts) do not share compiles"
        await compiler.matcher(Constraint("json_schema", "true"))  # JSON Schema's "anything"
        with pytest.raises(BadConstraint, match="allows no output"):
            await compiler.matcher(Constraint("json_schema", "false"))
        compiler.close()

    asyncio.run(main())


def test_size_bound_timeout_and_eviction() -> None:
    async def main() -> None:
        gate = threading.Event()
        backend = CountingBackend(gate)
        compiler = ConstraintCompiler(backend, max_spec_chars=100, timeout_s=0.2, cache_size=2)
        with pytest.raises(BadConstraint, match="the limit is 100"):
            await compiler.matcher(Constraint("regex", "a" * 101))
        assert backend.compiles == []
        slow = Constraint("regex", "x+")
        with pytest.raises(BadConstraint, match=r"did not compile within 0\.2 s"):
            await compiler.matcher(slow)
        gate.set()
        matcher, _ = await compiler.matcher(slow)  # the same compile, finished meanwhile
        assert len(backend.compiles) == 1 and _allowed(matcher.allowed_mask()) == {ord("x")}
        for spec in ("y", "z"):
            await compiler.matcher(Constraint("regex", spec))
        await compiler.matcher(slow)
        assert len(backend.compiles) == 4, "the least recently used spec was evicted"
        compiler.close()

    asyncio.run(main())


def test_json_allows_bounded_whitespace_and_eos_only_when_complete() -> None:
    async def main() -> None:
        compiler = ConstraintCompiler(GuidanceBackend(ByteTokenizer()))
        m, _ = await compiler.matcher(Constraint("json_object", ""))
        assert m.consume(ord("{"))
        for _ in range(2):
            assert ord(" ") in _allowed(m.allowed_mask()) and m.consume(ord(" "))
        assert ord(" ") not in _allowed(m.allowed_mask()), "whitespace is bounded"
        assert EOS_ID not in _allowed(m.allowed_mask())
        assert m.consume(ord("}")) and EOS_ID in _allowed(m.allowed_mask())
        assert not m.consume(ord("x")) and m.error()
        compiler.close()

    asyncio.run(main())


def test_masks_filled_together_are_each_matchers_own() -> None:
    """With enough CPUs the scheduler fills a step's masks in one call on the library's
    threads: each row is what that matcher alone allows, whatever the others' positions
    and grammars."""
    backend = GuidanceBackend(ByteTokenizer())
    matchers = [backend.compile(Constraint(kind, spec)).matcher() for kind, spec in (
        ("regex", "[ab]{2}c"), ("json_object", ""), ("choice", '["yes", "no"]'),
        ("regex", "[ab]{2}c"))]
    for m, prefix in zip(matchers, ("a", "{", "y", "ab"), strict=True):
        assert all(m.consume(ord(ch)) for ch in prefix)
    together = fill_together(matchers)
    assert together == allowed_masks(matchers) == [m.allowed_mask() for m in matchers]
    assert _allowed(together[3]) == {ord("c")}


def test_unpacked_masks_refuse_tokens_past_the_bitmap_and_nothing_in_unmasked_rows() -> None:
    mask = (1 | 1 << 31).to_bytes(4, "little") + (1 << 2).to_bytes(4, "little")  # 0, 31, 34
    rows = ~refused_tokens({0: mask, 2: mask[:4]}, 3, 70, torch.device("cpu"))
    assert rows.shape == (3, 70)
    assert torch.nonzero(rows[0]).flatten().tolist() == [0, 31, 34]
    assert rows[1].all()  # no mask: every token allowed
    assert torch.nonzero(rows[2]).flatten().tolist() == [0, 31]
    assert (~refused_tokens({0: mask}, 1, 33, torch.device("cpu")))[0].tolist() == (
        [True] + [False] * 30 + [True, False])
