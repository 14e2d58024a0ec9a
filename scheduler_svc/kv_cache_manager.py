"""Per-request KV block tables over one block pool, with prefix caching.

Tandem has one attention type, so this is one manager over one pool: no coordinator or
per-group managers. The scheduler sees block objects only when it passes prefix hits back
into :meth:`KVCacheManager.allocate_slots`; workers see block ids.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from scheduler_svc.block_pool import BlockPool, KVCacheBlock
from scheduler_svc.prefix_hash import HASH_SEED, BlockHash

log = logging.getLogger(__name__)


class KVCacheManager:
    """Block tables of the running requests, allocated from one :class:`BlockPool`.

    Invariants (checked whole by :meth:`check_invariants`, on top of the pool's):

    * a block's ``ref_cnt`` equals the number of block tables holding it (the tables are
      the only holders of references), and no table holds a block twice;
    * ``num_cached_blocks[r] <= len(block table of r)``: the prefix of ``r``'s table that
      has been offered to the hash map.

    A block table is append-only while its request runs; :meth:`free` drops it whole
    (finish, abort, or preemption by recompute, after which the request starts over with
    :meth:`get_computed_blocks`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._tables: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        if enable_caching:
            log.info(
                "prefix caching on: sha256 block hashes seeded with %r, %d tokens per block",
                HASH_SEED.decode(),
                block_size,
            )

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def max_num_tokens(self) -> int:
        """Tokens the whole pool holds: a request longer than this can never run."""
        return self.pool.num_blocks * self.block_size

    @property
    def prefix_cache_blocks(self) -> int:
        """Blocks holding a prefix hash, referenced or free (revivable)."""
        return self.pool.num_cached_blocks

    def get_computed_blocks(
        self, request_hashes: Sequence[BlockHash], num_tokens: int
    ) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request with ``num_tokens`` tokens, and its length.

        The hit is whole blocks and at most ``num_tokens - 1`` tokens: the last prompt token
        is always recomputed, because its forward pass yields the logits of the first output
        token. So a hit is block aligned and strictly shorter than the prompt, and an image
        whose span ends in the last block is never covered.

        The blocks are not referenced yet: pass them to :meth:`allocate_slots` in the same
        scheduling step, before anything else allocates. Hits are counted once per request,
        when it is admitted (``SchedulerCounters``), not here: a request that has to wait is
        looked up again every step.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = max(num_tokens - 1, 0) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Makes room for ``num_new_tokens`` more tokens; returns the newly allocated blocks.

        Returns None, changing nothing, when the free blocks do not suffice: the scheduler
        decides whether to preempt someone or to wait. Token ranges of the request::

            |<- num_computed_tokens ->|<- new_computed_blocks ->|<- num_new_tokens ->|
            | computed: KV written in | prefix-cache hit: KV    | to compute in this |
            | the request's table     | already in these blocks | step               |
            |---------------------------------------------------|--------------------|
            | blocks held: table + new_computed_blocks (these   | blocks allocated   |
            | are referenced now, reviving free cached ones)    | here, if needed    |

        A prefix hit only comes before anything is computed: ``new_computed_blocks``
        requires an empty table and ``num_computed_tokens == 0``. Nothing is cached here;
        :meth:`cache_blocks` registers blocks once their tokens are computed.
        """
        hits = list(new_computed_blocks or ())
        table = self._tables.get(request_id, [])
        assert num_new_tokens >= 0, f"num_new_tokens must be >= 0, got {num_new_tokens}"
        assert not hits or (not table and num_computed_tokens == 0), (
            f"prefix hit for request {request_id!r} that already has KV"
        )
        num_tokens = num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_needed = max(-(-num_tokens // self.block_size) - len(table) - len(hits), 0)
        # Hit blocks nobody references sit in the free queue: taking them uses free capacity.
        num_revived = sum(block.ref_cnt == 0 for block in hits)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(num_needed)
        if request_id not in self._tables:
            self._tables[request_id] = table
            # Hit blocks are cached already: cache_blocks starts after them.
            self._num_cached_blocks[request_id] = len(hits)
        table.extend(hits)
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_computed_tokens: int
    ) -> None:
        """Registers the request's full, computed blocks in the prefix-hash map.

        Call after the step that computed them: only blocks whose every token has its KV
        written (``num_computed_tokens // block_size`` of them) are offered, never a
        partial block or one holding a sampled but not yet computed token.
        ``block_hashes`` are the request's chained hashes and must cover those blocks.
        """
        if not self.enable_caching:
            return
        table = self._tables.get(request_id)
        assert table is not None, f"cache_blocks for request {request_id!r} holding no blocks"
        num_full = num_computed_tokens // self.block_size
        assert num_full <= len(table), (
            f"request {request_id!r}: {num_full} computed blocks but {len(table)} allocated"
        )
        assert len(block_hashes) >= num_full, (
            f"request {request_id!r}: {len(block_hashes)} hashes for {num_full} full blocks"
        )
        done = self._num_cached_blocks[request_id]
        if num_full > done:
            self.pool.cache_full_blocks(table[done:num_full], block_hashes[done:num_full])
            self._num_cached_blocks[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Releases the request's blocks; a no-op for a request that holds none.

        Freed in reverse so a hash chain's tail is evicted before its head, which other
        requests are likelier to share.
        """
        table = self._tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            ids = [block.block_id for block in table]
            assert len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice"
            holders.update(ids)
            cached = self._num_cached_blocks[request_id]
            assert 0 <= cached <= len(table), f"request {request_id!r}: {cached} cached blocks"
        assert self._tables.keys() == self._num_cached_blocks.keys(), "request sets differ"
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block} is held by {holders[block.block_id]} block tables"
            )
