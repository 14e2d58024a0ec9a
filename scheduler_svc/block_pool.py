"""KV block metadata, the free-block queue and the pool with its prefix-hash map.

The scheduler owns this bookkeeping; the workers own the KV tensors and only ever see
block ids. All ``num_blocks`` ids are allocatable: there is no null block, because Tandem
has only full attention and every block-table entry is a real block. A worker that needs
a scratch block (for padded batch slots) allocates it beyond ``num_blocks``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler_svc.prefix_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one KV block.

    ``ref_cnt`` is the number of requests whose block table holds the block (mutated only
    by :class:`BlockPool`). The hash is write-once: set when the block becomes a full,
    cached block, cleared only by :meth:`reset_hash` when the pool evicts it. The free-list
    links are owned by :class:`FreeBlockQueue`; no one else may touch them.
    """

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, value: BlockHash) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = value

    def reset_hash(self) -> None:
        """Forgets the hash: the block's contents are about to be overwritten."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Neighbour ids, never the neighbours themselves: printing them would recurse.
        prev_id = self.prev_free.block_id if self.prev_free else None
        next_id = self.next_free.block_id if self.next_free else None
        digest = self._block_hash.hex()[:8] if self._block_hash else None
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest}, "
            f"prev_free={prev_id}, next_free={next_id})"
        )


class FreeBlockQueue:
    """The blocks nobody references, in eviction order: front is evicted first.

    A doubly linked list through the blocks' own ``prev_free``/``next_free`` fields.
    NOTE: not a ``deque``: touching a cached free block (a prefix hit) removes it from the
    middle, which a deque does in O(n); here it is O(1) and allocates no Python objects.
    Sentinel head and tail nodes remove every empty-list and end-of-list branch.

    Order invariant: least recently freed first; among blocks freed together, the tail of
    a hash chain first (callers free a request's blocks in reverse), so a chain is evicted
    from its end and its still-useful prefix survives longest.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, (
            f"pop from an empty free queue (counter says {self.num_free_blocks})"
        )
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the back: evicted last."""
        last = self._tail.prev_free
        assert last is not None
        self._insert(block, last, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Puts ``block`` at the front: reused first."""
        first = self._head.next_free
        assert first is not None
        self._insert(block, self._head, first)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def _insert(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} already queued"
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front to back; O(n), for invariant checks and tests."""
        out = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            out.append(node)
            node = node.next_free
        return out

    def check_invariants(self) -> None:
        """Links agree in both directions, and the counter equals the list's length."""
        seen: set[int] = set()
        prev, node = self._head, self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue broken: a forward link is missing"
            assert node.prev_free is prev, f"free queue back link of {node} is wrong"
            assert node.block_id not in seen, f"block {node.block_id} twice in the free queue"
            seen.add(node.block_id)
            prev, node = node, node.next_free
        assert self._tail.prev_free is prev, "free queue tail back link is wrong"
        assert len(seen) == self.num_free_blocks, (
            f"free queue out of sync: {len(seen)} linked, counter {self.num_free_blocks}"
        )


class BlockPool:
    """All KV blocks, the free queue and the prefix-hash map.

    Invariants (checked whole by :meth:`check_invariants`):

    * every block is either referenced (``ref_cnt > 0``) or in the free queue, never both:
      free + referenced == ``num_blocks``;
    * each hash-map entry maps to a block carrying that hash, and every block carrying a
      hash is in the map (so a free block with a hash is a cached, revivable block);
    * with caching disabled no block carries a hash.

    Only the pool mutates ``ref_cnt``, the hashes and the map. "No room" is the caller's
    check (:attr:`num_free_blocks`); asking for more than is free raises ValueError (a bug,
    but one that must not pass silently under ``python -O``).
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Prefix-hash map: hash -> the one block registered under it.
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, including cached blocks that would be evicted."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a prefix hash (referenced or free)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Takes ``n`` blocks from the front of the free queue, evicting cached ones.

        An evicted block leaves the hash map: its contents will be overwritten.
        """
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.reset_hash()
            block.ref_cnt = 1
            out.append(block)
        return out

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Registers ``blocks[i]`` (full, computed, referenced) under ``block_hashes[i]``.

        NOTE: identical blocks are not de-duplicated. When another block already holds the
        hash (two requests computed the same prefix at once), this block stays unhashed:
        swapping it for the cached one would change a block id already in a running
        request's block table, and block tables are append-only.
        """
        assert len(blocks) == len(block_hashes), "one hash per block"
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            assert block.ref_cnt > 0, f"caching unreferenced {block}"
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"{block} re-cached under another hash"
            elif block_hash not in self._cached:
                block.block_hash = block_hash
                self._cached[block_hash] = block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Adds one reference to each block (a prefix hit), reviving cached free blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block, in eviction order (pass chain tails first).

        Blocks reaching zero references join the free queue: unhashed ones at the front
        (they hold nothing reusable, so they are reused first), hashed ones at the back in
        the given order, so cached prefixes are evicted least recently used.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"freeing unreferenced {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def check_invariants(self) -> None:
        self.free_queue.check_invariants()
        free_ids = {b.block_id for b in self.free_queue.get_all_free_blocks()}
        referenced = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref_cnt: {block}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"ref_cnt == 0 must mean 'in the free queue': {block}"
            )
            referenced += block.ref_cnt > 0
        assert len(free_ids) + referenced == self.num_blocks, (
            f"free {len(free_ids)} + referenced {referenced} != total {self.num_blocks}"
        )
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"hash map entry points to {block}"
        hashed = sum(b.block_hash is not None for b in self.blocks)
        assert hashed == len(self._cached), (
            f"{hashed} blocks carry a hash but the map has {len(self._cached)} entries"
        )
        assert self.enable_caching or not hashed, "caching is off but blocks carry hashes"
