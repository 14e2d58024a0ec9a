"""KV cache manager: allocation, prefix hits, caching of computed blocks, preemption."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.prefix_hash import BlockHash, request_block_hashes
from tandem.features import MultiModalFeatureSpec, PlaceholderRange
from tandem.text.byte_tokenizer import IMAGE_ID


def _feature(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(identifier, "image", PlaceholderRange(offset, length), None)


def _prefill(
    kv: KVCacheManager, rid: str, tokens: list[int], salt: str | None = None,
    features: list[MultiModalFeatureSpec] | None = None,
) -> tuple[list[BlockHash], int]:
    """Admits a request and computes its whole prompt in one step; returns (hashes, hit)."""
    hashes = request_block_hashes(tokens, features or [], kv.block_size, salt)
    hits, num_hit = kv.get_computed_blocks(hashes, len(tokens))
    assert kv.allocate_slots(rid, len(tokens) - num_hit, 0, hits) is not None
    kv.check_invariants()
    kv.cache_blocks(rid, hashes, len(tokens))
    kv.check_invariants()
    return hashes, num_hit


def test_allocation_grows_only_at_block_boundaries() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    new = kv.allocate_slots("a", 40)
    kv.check_invariants()
    assert new is not None and len(new) == 3
    assert kv.get_block_ids("a") == [b.block_id for b in new]
    assert kv.allocate_slots("a", 8, num_computed_tokens=40) == []  # 48 tokens: still 3
    kv.check_invariants()
    grown = kv.allocate_slots("a", 1, num_computed_tokens=48)
    kv.check_invariants()
    assert grown is not None and len(grown) == 1
    assert len(kv.get_block_ids("a")) == 4
    assert kv.num_free_blocks == 4 and kv.usage == pytest.approx(0.5)
    assert kv.max_num_tokens == 128


def test_no_room_is_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 48) is not None
    assert kv.allocate_slots("b", 17) is None
    kv.check_invariants()
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks == 1
    kv.free("b")  # a request that never got blocks frees nothing
    kv.check_invariants()
    assert kv.allocate_slots("b", 16) is not None


def test_hit_is_capped_so_the_last_prompt_token_is_recomputed() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=16)
    prompt = list(range(48))  # exactly three blocks
    _prefill(kv, "a", prompt)
    kv.free("a")
    kv.check_invariants()

    hashes = request_block_hashes(prompt, [], 16, None)
    _, num_hit = kv.get_computed_blocks(hashes, len(prompt))
    assert num_hit == 32, "a full hit would leave no token to compute logits from"
    longer = [*prompt, 99]
    hits, num_hit = kv.get_computed_blocks(request_block_hashes(longer, [], 16, None), 49)
    assert num_hit == 48 and len(hits) == 3


def test_prefix_hit_shares_blocks_and_only_new_tokens_get_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=16)
    shared = list(range(40))
    _prefill(kv, "a", [*shared, 1, 2])
    _, num_hit = _prefill(kv, "b", [*shared, 3, 4, 5])
    assert num_hit == 32
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert a_ids[:2] == b_ids[:2] and a_ids[2] != b_ids[2]
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [2, 2]
    kv.free("a")
    kv.check_invariants()
    assert [kv.pool.blocks[i].ref_cnt for i in b_ids[:2]] == [1, 1]


def test_mm_prefix_hit_needs_the_same_images() -> None:
    # vLLM test_mm_prefix_caching: images at (11,10) "aaa", (30,18) "bbb", (48,7) "ccc".
    images = [IMAGE_ID] * 10 + [2] * 9 + [IMAGE_ID] * 18 + [IMAGE_ID] * 7
    tokens = [1] * 11 + images + [3] * 4
    features = [_feature("aaa", 11, 10), _feature("bbb", 30, 18), _feature("ccc", 48, 7)]
    kv = KVCacheManager(num_blocks=32, block_size=16)
    _prefill(kv, "a", tokens, features=features)
    _, num_hit = _prefill(kv, "b", [1] * 11 + images + [4] * 6, features=features)
    assert num_hit == 48, "same images, different trailing text: three blocks hit"

    other = [_feature("aaa", 11, 10), _feature("zzz", 30, 18), _feature("ccc", 48, 7)]
    _, num_hit = _prefill(kv, "c", tokens, features=other)
    assert num_hit == 16, "a different second image breaks the chain at its first block"


def test_image_ending_in_the_last_prompt_block_is_never_covered_by_a_hit() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=16)
    # The image ends the prompt (so it ends in the last block), or a text block follows.
    for end_text in (0, 3):
        tokens = [1] * 16 + [IMAGE_ID] * 16 + [2] * end_text
        features = [_feature(f"img{end_text}", 16, 16)]
        _prefill(kv, f"a{end_text}", tokens, features=features)
        _, num_hit = _prefill(kv, f"b{end_text}", tokens, features=features)
        assert num_hit == (16 if end_text == 0 else 32)
        assert features[0].is_covered(num_hit) == (end_text > 0)
        assert num_hit < len(tokens)


def test_salt_isolates_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(20))
    _prefill(kv, "a", prompt, salt="t1")
    assert _prefill(kv, "b", prompt, salt="t2")[1] == 0
    assert _prefill(kv, "c", prompt, salt="t1")[1] == 16


def test_only_full_computed_blocks_are_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=16)
    prompt = list(range(40))
    hashes = request_block_hashes(prompt, [], 16, None)
    assert kv.allocate_slots("a", 20) is not None  # a first prefill chunk of 20 tokens
    kv.cache_blocks("a", hashes, 20)
    kv.check_invariants()
    assert kv.prefix_cache_blocks == 1
    assert kv.allocate_slots("a", 20, num_computed_tokens=20) is not None
    kv.cache_blocks("a", hashes, 40)
    kv.check_invariants()
    assert kv.prefix_cache_blocks == 2, "the partial third block stays unhashed"
    with pytest.raises(AssertionError, match="hashes for"):
        kv.cache_blocks("a", hashes[:1], 40)


def test_free_evicts_chain_tails_first_and_older_requests_first() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    old = list(range(100, 113))  # 3 full blocks + 1 token
    new = list(range(200, 213))
    _prefill(kv, "old", old)
    _prefill(kv, "new", new)
    kv.free("old")
    kv.free("new")
    kv.check_invariants()
    # Three blocks: the two unhashed partial blocks, then the older chain's tail.
    assert kv.allocate_slots("x", 12) is not None
    kv.check_invariants()
    assert kv.get_computed_blocks(request_block_hashes(old, [], 4, None), 13)[1] == 8
    assert kv.get_computed_blocks(request_block_hashes(new, [], 4, None), 13)[1] == 12


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(10))
    hashes, _ = _prefill(kv, "a", prompt)
    kv.free("a")  # preempted by recompute
    kv.check_invariants()
    hits, num_hit = kv.get_computed_blocks(hashes, len(prompt))
    assert num_hit == 8
    new = kv.allocate_slots("a", 2, 0, hits)
    kv.check_invariants()
    assert new is not None and len(new) == 1
    assert kv.get_block_ids("a")[:2] == [b.block_id for b in hits]


def test_hit_blocks_count_against_free_space_when_unreferenced() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    prompt = list(range(9))
    hashes, _ = _prefill(kv, "a", prompt)
    kv.free("a")
    hits, num_hit = kv.get_computed_blocks(hashes, 9)
    assert num_hit == 8
    # The two hit blocks leave one free block; 9 more tokens need three more.
    assert kv.allocate_slots("a", 9, 0, hits) is None
    kv.check_invariants()
    assert kv.allocate_slots("a", 4, 0, hits) is not None
    kv.check_invariants()
    assert kv.num_free_blocks == 0


def test_caching_disabled() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    prompt = list(range(12))
    _prefill(kv, "a", prompt)
    assert _prefill(kv, "b", prompt)[1] == 0
    assert kv.prefix_cache_blocks == 0


def test_concurrent_identical_prefixes_are_both_valid() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(9))
    hashes = request_block_hashes(prompt, [], 4, None)
    for rid in ("a", "b"):  # both miss: neither has computed anything yet
        assert kv.get_computed_blocks(hashes, 9)[1] == 0
        assert kv.allocate_slots(rid, 9) is not None
    for rid in ("a", "b"):
        kv.cache_blocks(rid, hashes, 9)
        kv.check_invariants()
    assert kv.prefix_cache_blocks == 2
    kv.free("a")
    kv.free("b")
    kv.check_invariants()
    assert kv.get_computed_blocks(hashes, 9)[1] == 8


# Model-based check: a simulated KV store records what each slot holds, so every prefix
# hit can be compared with what the request would have computed itself.

Slot = tuple[int, str | None, str | None]  # (token, image id at this position, salt)


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    features: list[MultiModalFeatureSpec]
    salt: str | None
    computed: int = 0
    hashes: list[BlockHash] = field(default_factory=list)

    def content(self, pos: int) -> Slot:
        image = next(
            (f.identifier for f in self.features
             if f.mm_position.offset <= pos < f.mm_position.end), None,
        )
        return (self.tokens[pos], image, self.salt)


class _Sim:
    def __init__(self, rng: random.Random, num_blocks: int, block_size: int) -> None:
        self.rng = rng
        self.kv = KVCacheManager(num_blocks, block_size)
        self.slots: dict[tuple[int, int], Slot] = {}
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.count = 0

    def add(self) -> None:
        rng, bs = self.rng, self.kv.block_size
        prefix = rng.choice([[], [1] * 5, [1] * 5 + [2] * 4, [3] * 9])
        tokens = prefix + [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        features = []
        if rng.random() < 0.5:  # an image right after the shared prefix
            at = len(prefix)
            tokens[at:at] = [IMAGE_ID] * 3
            features.append(_feature(rng.choice(["p", "q"]), at, 3))
        req = _Req(f"r{self.count}", tokens, features, rng.choice([None, None, "t"]))
        req.hashes = request_block_hashes(tokens, features, bs, req.salt)
        self.count += 1
        self.waiting.append(req)

    def admit(self) -> None:
        req = self.rng.choice(self.waiting)
        hits, num_hit = self.kv.get_computed_blocks(req.hashes, len(req.tokens))
        for pos in range(num_hit):
            block = hits[pos // self.kv.block_size]
            assert self.slots[block.block_id, pos % self.kv.block_size] == req.content(pos)
        chunk = self.rng.randint(1, len(req.tokens) - num_hit)
        if self.kv.allocate_slots(req.rid, chunk, 0, hits) is None:
            return self.preempt_one()
        self.waiting.remove(req)
        self.running.append(req)
        req.computed = num_hit
        self.compute(req, chunk)

    def advance(self) -> None:
        req = self.rng.choice(self.running)
        if req.computed == len(req.tokens):  # decode: sample one more token
            req.tokens.append(self.rng.randrange(4))
            req.hashes += request_block_hashes(
                req.tokens, req.features, self.kv.block_size, req.salt, known=req.hashes
            )
        n = self.rng.randint(1, len(req.tokens) - req.computed)
        if self.kv.allocate_slots(req.rid, n, req.computed) is None:
            return self.preempt_one()
        self.compute(req, n)

    def compute(self, req: _Req, n: int) -> None:
        table = self.kv.get_block_ids(req.rid)
        for pos in range(req.computed, req.computed + n):
            block_id = table[pos // self.kv.block_size]
            assert self.kv.pool.blocks[block_id].ref_cnt == 1, "writing into a shared block"
            self.slots[block_id, pos % self.kv.block_size] = req.content(pos)
        req.computed += n
        self.kv.cache_blocks(req.rid, req.hashes, req.computed)

    def preempt_one(self) -> None:
        if self.running:
            self.finish(self.rng.choice(self.running), requeue=True)

    def finish(self, req: _Req, requeue: bool = False) -> None:
        self.kv.free(req.rid)
        self.running.remove(req)
        if requeue:  # recompute: generated tokens become part of the prompt
            req.computed = 0
            self.waiting.append(req)

    def step(self) -> None:
        ops = [self.add]
        if self.waiting:
            ops.append(self.admit)
        if self.running:
            ops += [self.advance, self.advance, lambda: self.finish(self.rng.choice(self.running))]
        self.rng.choice(ops)()
        self.kv.check_invariants()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([(10, 4), (6, 3), (24, 2)]))
def test_random_schedules_keep_invariants_and_hits_match_computed_kv(
    seed: int, pool: tuple[int, int]
) -> None:
    sim = _Sim(random.Random(seed), *pool)
    for _ in range(150):
        sim.step()
    for req in list(sim.running):
        sim.finish(req)
    sim.kv.check_invariants()
    assert sim.kv.num_free_blocks == pool[0]
