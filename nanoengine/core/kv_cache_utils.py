"""The smallest pieces of the KV cache manager: a block, the free list, block hashes.

Chapter 4 (KV cache manager) builds everything else on these three ideas:

* ``KVCacheBlock`` is the bookkeeping for one physical block of the KV cache
  tensors (the tensors themselves live in the worker; here a block is just an id,
  a reference count and, once full, the hash of its contents).
* ``FreeKVCacheBlockQueue`` is a doubly linked list of the blocks nobody uses.
  It doubles as the LRU list of the prefix cache: a freed block keeps its hash,
  goes to the tail, and is only forgotten when it reaches the head and is reused.
* ``hash_block_tokens`` / ``get_request_block_hasher`` name a full block by its
  tokens *and everything before it*, so equal hashes mean equal KV.

vLLM 0.32 counterpart: ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``,
``FreeKVCacheBlockQueue``, ``hash_block_tokens``, ``get_request_block_hasher``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nanoengine.request import BlockHash, Request

# The "parent" of a request's first block. A fixed value (rather than vLLM's
# per-process random seed) keeps hashes identical across runs, which makes tests
# and printed hashes reproducible; it also gives every hash input one layout.
NONE_HASH: BlockHash = hashlib.sha256(b"nanoengine: no parent block").digest()


# A block's key in the prefix cache: its hash and the KV cache group it belongs
# to. The groups of a hybrid model hash the same tokens to the same hash, but
# each keeps different layers' K/V in its blocks, so a hit must come from the
# group that asks. vLLM 0.32 appends the group id to the hash bytes the same way.
BlockHashWithGroupId = bytes


def make_block_hash_with_group_id(block_hash: BlockHash, kv_cache_group_id: int) -> BlockHashWithGroupId:
    """The hash followed by the group id, as 4 big-endian bytes."""
    return block_hash + kv_cache_group_id.to_bytes(4, "big")


@dataclass(eq=False, repr=False, slots=True)
class KVCacheBlock:
    """Metadata of one physical KV cache block.

    ``ref_cnt`` counts the requests whose block table holds this block; a block
    with ``ref_cnt == 0`` sits in the free queue. ``block_hash`` is set once the
    block is full and registered in the prefix cache (its key there: the hash
    of its tokens and its group's id), and cleared on eviction.
    The two ``*_free_block`` pointers are owned by ``FreeKVCacheBlockQueue``: they
    live on the block itself so removing a block from the middle needs no search.
    """

    # eq=False: blocks are compared by identity (two blocks with equal fields are
    # still two different pieces of memory), and comparing the pointer fields
    # would recurse through the whole list. slots: a pool holds many blocks.
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        # Print neighbours by id only: following the pointers would walk the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        digest = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest}, "
            f"prev_free={prev_id}, next_free={next_id})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks, in eviction order: head = evicted next, tail = freed last.

    A Python ``deque`` would give O(1) ends but O(n) removal from the middle, and
    the prefix cache needs exactly that: a cache hit on a free block "revives" it,
    pulling it out of the queue wherever it is. Two sentinel nodes (fake head and
    fake tail) mean every real block always has both neighbours, so no operation
    needs an "is this the first/last block?" branch.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        # Sentinels carry block_id -1; they are never handed out.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Take the block at the head (the least recently freed one)."""
        first = self.fake_free_list_head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            raise ValueError("popleft() on an empty free block queue.")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head, oldest first."""
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} are free.")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue, in O(1).

        The block knows its neighbours, so we make them point at each other and
        the block simply drops out; thanks to the sentinels both always exist.
        """
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"remove() of block {block.block_id}, which is not in the free queue.")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        # Cleared pointers are how we recognise "not in the queue" later.
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it becomes the last candidate for eviction."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None  # the head sentinel at worst
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` in order: ``blocks[0]`` will be evicted first."""
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Walk the list head to tail (O(n); for tests and debugging only)."""
        result: list[KVCacheBlock] = []
        node = self.fake_free_list_head.next_free_block
        while node is not None and node is not self.fake_free_list_tail:
            result.append(node)
            node = node.next_free_block
        return result


def hash_block_tokens(parent_block_hash: BlockHash | None, curr_block_token_ids: Sequence[int]) -> BlockHash:
    """Hash one full block, chained on the hash of the block before it.

    Chaining is what makes a hash name a whole *prefix*: two blocks holding the
    same 16 tokens after different histories have different KV (attention saw
    different context), so they must not share a hash. Folding the parent's
    hash in gives that for free, and makes a lookup of block i an O(1) dict get.

    sha256 over fixed-width little-endian integers is deterministic across
    processes and machines (Python's built-in ``hash`` is salted per process).
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    # "<{n}q": n signed 64-bit little-endian ints, wide enough for any vocab.
    packed = struct.pack(f"<{len(curr_block_token_ids)}q", *curr_block_token_ids)
    return hashlib.sha256(parent + packed).digest()


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """Return the function a ``Request`` calls to hash its newly completed blocks.

    The request keeps ``block_hashes`` for every full block so far; each call
    hashes only the blocks filled since the last call, continuing the chain from
    ``request.block_hashes[-1]``. A partial last block gets no hash: its KV is
    not final yet, so it cannot be shared.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}.")

    def request_block_hasher(request: Request) -> list[BlockHash]:
        token_ids = request.all_token_ids
        start = len(request.block_hashes) * block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        # Stop before a block that would run past the known tokens.
        while start + block_size <= len(token_ids):
            parent = hash_block_tokens(parent, token_ids[start : start + block_size])
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher
