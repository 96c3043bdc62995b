"""The grader's checks for exercises 4.1, 4.2 and 4.3 (chapter 4).

Each promise of an exercise's page has a unit check of its own, named by that
promise, so a wrong answer is named by the behaviour it breaks; the unit checks
call the function directly, on a manager or queue of a handful of blocks, to
reach cases a short generation never would. The end-to-end runs come last.
Every check returns a dict whose keys name the call and its inputs, so a
failure shows just the calls whose answers differ. The first paragraph of each
check's docstring is what the exercise page lists as its inputs.

All managers here use blocks of 4 tokens (``kv_spec()``), and block 0 is the
pool's null block, so a pool of ``num_blocks`` gives ``num_blocks - 1`` usable
blocks, handed out lowest id first.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from chapters.grade_checks.common import (
    Check,
    block_ids,
    e2e_preemption,
    e2e_prefix_cache,
    kv_spec,
    make_request,
)
from nanoengine.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from nanoengine.core.kv_cache_utils import NONE_HASH, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens
from nanoengine.kv_cache_interface import KVCacheConfig
from nanoengine.request import Request

BLOCK_SIZE = 4


def _outcome(call: Callable[[], Any]) -> Any:
    """What ``call`` returned, or the name of the exception it raised.

    For checks whose promise is an exception: recording the exception's type
    (rather than letting it end the check) lets the message say "expected
    'ValueError', got 'no error'" next to the other answers. An unwritten stub
    still ends the check, so the grader reports its NotImplementedError as such.
    """
    try:
        value = call()
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 -- the exception type is the answer being checked
        kind = type(error)
        name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
        return f"raised {name}"
    return "no error" if value is None else value


# -------------------------------------------------- 4.1 allocate_slots
def _manager(num_blocks: int, max_model_len: int = 64, enable_caching: bool = True) -> KVCacheManager:
    config = KVCacheConfig(num_blocks=num_blocks, spec=kv_spec(BLOCK_SIZE))
    return KVCacheManager(config, max_model_len=max_model_len, enable_caching=enable_caching)


def _cached_block_ids(manager: KVCacheManager, request: Request) -> tuple[list[int], ...]:
    """The blocks of ``request``'s table that are registered in the prefix cache."""
    tables = manager.coordinator.get_blocks(request.request_id)
    return tuple([b.block_id for b in table if b.block_hash is not None] for table in tables)


def _hit_block_ids(manager: KVCacheManager, request: Request) -> tuple[list[int], ...]:
    """Which blocks a prefix-cache lookup of ``request`` finds (the lookup claims nothing)."""
    return manager.get_computed_blocks(request)[0].get_block_ids()


def _each_block(blocks: KVCacheBlocks) -> list[KVCacheBlock]:
    """Every block of every group, in group order."""
    return [block for group in blocks.blocks for block in group]


def new_blocks_as_a_request_grows(model: str) -> dict[str, Any]:
    """8 free blocks: ``first`` (10 tokens) is given slots for its prompt, then
    for one decode token (the 11th, which fits the 3rd block) and for two more
    (the 12th and 13th, which need a 4th block).
    """
    manager = _manager(num_blocks=9)
    first = make_request("first", 10, block_size=BLOCK_SIZE)
    result: dict[str, Any] = {
        "allocate_slots(first, 10 new tokens): new block ids": block_ids(manager.allocate_slots(first, 10)),
    }
    first.num_computed_tokens = 10
    first.append_output_token_ids(99)
    result["then allocate_slots(first, 1 new token), the 11th: new block ids"] = block_ids(
        manager.allocate_slots(first, 1))
    first.num_computed_tokens = 11
    first.append_output_token_ids([98, 97])
    result["then allocate_slots(first, 2 new tokens), the 12th and 13th: new block ids"] = block_ids(
        manager.allocate_slots(first, 2))
    result["afterwards: first's whole block table"] = manager.get_block_ids("first")
    result["afterwards: free blocks"] = manager.num_free_blocks
    return result


def cache_hits_claimed_first(model: str) -> dict[str, Any]:
    """5 usable blocks: ``a`` (8 tokens) and ``b`` (8 other tokens) take 4 and
    finish, which leaves a's two cached blocks near the head of the free queue;
    then ``twin`` (a's 8 tokens and 8 more) hits them and asks for 8 new tokens,
    2 new blocks.
    """
    manager = _manager(num_blocks=6)
    a = make_request("a", 8, block_size=BLOCK_SIZE)
    b = make_request("b", 8, block_size=BLOCK_SIZE, first_token=100)
    result: dict[str, Any] = {}
    for request in (a, b):
        result[f"allocate_slots({request.request_id}, 8 new tokens): new block ids"] = block_ids(
            manager.allocate_slots(request, 8))
    for request in (a, b):  # both finish; a's blocks are freed first, so they are evicted first
        request.num_computed_tokens = 8
        manager.free(request)
    queue = manager.block_pool.free_block_queue.get_all_free_blocks()
    result["after a and b finish: free queue, head (evicted first) to tail"] = [block.block_id for block in queue]
    twin = make_request("twin", 16, block_size=BLOCK_SIZE)
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    result["get_computed_blocks(twin): hit block ids"] = block_ids(hits)
    # Taking new blocks from the head before claiming the hits would take (and
    # evict) the second hit block.
    new_blocks = manager.allocate_slots(twin, 16 - num_hit_tokens, num_hit_tokens, hits)
    label = f"allocate_slots(twin, {16 - num_hit_tokens} new tokens after {num_hit_tokens} hit tokens)"
    result[f"{label}: new block ids"] = block_ids(new_blocks)
    result[f"{label}: twin's whole block table"] = manager.get_block_ids("twin")
    result[f"{label}: hit blocks' ref_cnt"] = [block.ref_cnt for block in _each_block(hits)]
    result[f"{label}: hit blocks still in the prefix cache"] = [
        block.block_hash is not None for block in _each_block(hits)]
    result[f"{label}: free blocks"] = manager.num_free_blocks
    return result


def all_or_nothing(model: str) -> dict[str, Any]:
    """8 usable blocks. ``huge`` asks for 40 tokens (10 blocks). Then ``a`` (8
    tokens) runs and finishes, so its 2 cached blocks wait in the free queue
    (ref_cnt 0), and ``twin`` (a's 8 tokens and 52 more) hits them but needs 15
    blocks in all. Last, ``snug`` asks for 32 tokens: exactly the 8 free blocks.
    """
    manager = _manager(num_blocks=9)
    result: dict[str, Any] = {}
    huge = make_request("huge", 40, block_size=BLOCK_SIZE, first_token=100)
    result["allocate_slots(huge, 40 new tokens), 8 blocks free"] = block_ids(manager.allocate_slots(huge, 40))
    result["after huge: free blocks"] = manager.num_free_blocks
    result["after huge: huge's block table"] = manager.get_block_ids("huge")

    a = make_request("a", 8, block_size=BLOCK_SIZE)
    result["allocate_slots(a, 8 new tokens): new block ids"] = block_ids(manager.allocate_slots(a, 8))
    a.num_computed_tokens = 8
    manager.free(a)
    twin = make_request("twin", 60, block_size=BLOCK_SIZE)
    hits, num_hit_tokens = manager.get_computed_blocks(twin)
    result["get_computed_blocks(twin): hit block ids"] = block_ids(hits)
    # The hits are evictable (ref_cnt 0), so claiming them would take them out
    # of the free queue: an answer that claims before it checks leaves them held.
    label = f"allocate_slots(twin, {60 - num_hit_tokens} new tokens after {num_hit_tokens} hit tokens)"
    result[label] = block_ids(manager.allocate_slots(twin, 60 - num_hit_tokens, num_hit_tokens, hits))
    result[f"after {label}: hit blocks' ref_cnt"] = [block.ref_cnt for block in _each_block(hits)]
    result[f"after {label}: hit blocks still in the prefix cache"] = [
        b.block_hash is not None for b in _each_block(hits)]
    result[f"after {label}: free blocks"] = manager.num_free_blocks
    result[f"after {label}: twin's block table"] = manager.get_block_ids("twin")

    snug = make_request("snug", 32, block_size=BLOCK_SIZE, first_token=200)
    result["allocate_slots(snug, 32 new tokens), exactly the free blocks: new block ids"] = block_ids(
        manager.allocate_slots(snug, 32))
    result["after snug: free blocks"] = manager.num_free_blocks
    return result


def capped_at_max_model_len(model: str) -> dict[str, Any]:
    """max_model_len 8 (2 blocks of 4): ``long`` (8 tokens) is given slots for
    its prompt, then for a 9th token, which would start a 3rd block.
    """
    manager = _manager(num_blocks=9, max_model_len=8)
    long = make_request("long", 8, block_size=BLOCK_SIZE)
    result: dict[str, Any] = {
        "allocate_slots(long, 8 new tokens), max_model_len 8: new block ids": block_ids(
            manager.allocate_slots(long, 8)),
    }
    long.num_computed_tokens = 8
    long.append_output_token_ids(99)
    result["then allocate_slots(long, 1 new token), the 9th: new block ids"] = block_ids(
        manager.allocate_slots(long, 1))
    result["afterwards: long's whole block table"] = manager.get_block_ids("long")
    result["afterwards: free blocks"] = manager.num_free_blocks
    return result


def hashes_only_existing_tokens(model: str) -> dict[str, Any]:
    """``ahead`` has 6 tokens (one full block and half of the next) but asks
    for 8 slots, room for tokens that do not exist yet; then ``probe``, with
    the same 6 tokens and 4 more, looks itself up in the prefix cache.
    """
    manager = _manager(num_blocks=9)
    ahead = make_request("ahead", 6, block_size=BLOCK_SIZE)
    result: dict[str, Any] = {
        "allocate_slots(ahead, 8 new tokens), ahead has 6 tokens: new block ids": block_ids(
            manager.allocate_slots(ahead, 8)),
        "then: ahead's blocks in the prefix cache": _cached_block_ids(manager, ahead),
        "then get_computed_blocks(probe): hit block ids": _hit_block_ids(
            manager, make_request("probe", 10, block_size=BLOCK_SIZE)),
    }
    return result


def delayed_caching(model: str) -> dict[str, Any]:
    """``loading`` (8 tokens) is given slots with delay_cache_blocks=True, as
    while a KV connector loads its blocks, and ``early`` (the same 8 tokens and
    4 more) looks itself up; then loading's next token gets a slot without the
    delay, and early looks again.
    """
    manager = _manager(num_blocks=9)
    loading = make_request("loading", 8, block_size=BLOCK_SIZE, first_token=200)
    early = make_request("early", 12, block_size=BLOCK_SIZE, first_token=200)
    label = "allocate_slots(loading, 8 new tokens, delay_cache_blocks=True)"
    result: dict[str, Any] = {f"{label}: new block ids": block_ids(
        manager.allocate_slots(loading, 8, delay_cache_blocks=True))}
    result[f"after {label}: loading's blocks in the prefix cache"] = _cached_block_ids(manager, loading)
    result[f"after {label}: get_computed_blocks(early): hit block ids"] = _hit_block_ids(manager, early)
    loading.num_computed_tokens = 8
    loading.append_output_token_ids(300)
    label = "then allocate_slots(loading, 1 new token), no delay"
    result[f"{label}: new block ids"] = block_ids(manager.allocate_slots(loading, 1))
    result[f"after {label}: loading's blocks in the prefix cache"] = _cached_block_ids(manager, loading)
    result[f"after {label}: get_computed_blocks(early): hit block ids"] = _hit_block_ids(manager, early)
    return result


def caching_disabled(model: str) -> dict[str, Any]:
    """A manager built with enable_caching=False gives ``plain`` (8 tokens, whose
    2 full blocks have hashes) slots for all 8.
    """
    manager = _manager(num_blocks=9, enable_caching=False)
    plain = make_request("plain", 8, block_size=BLOCK_SIZE)
    return {
        "allocate_slots(plain, 8 new tokens), caching off: new block ids": block_ids(
            manager.allocate_slots(plain, 8)),
        "then: plain's blocks in the prefix cache": _cached_block_ids(manager, plain),
        "then: hashes in the prefix cache": len(manager.block_pool.cached_block_hash_to_block),
    }


def rejects_no_new_tokens(model: str) -> dict[str, Any]:
    """``r`` (3 tokens) asks for 0 new tokens, then for -1."""
    manager = _manager(num_blocks=9)
    request = make_request("r", 3, block_size=BLOCK_SIZE)

    def allocate(num_new_tokens: int) -> str:
        return f"returned {block_ids(manager.allocate_slots(request, num_new_tokens))}"

    result: dict[str, Any] = {f"allocate_slots(r, {n} new tokens)": _outcome(partial(allocate, n)) for n in (0, -1)}
    result["afterwards: r's block table"] = manager.get_block_ids("r")
    result["afterwards: free blocks"] = manager.num_free_blocks
    return result


# --------------------------------------------------- 4.2 hash_block_tokens
def _shown(block_hash: object) -> object:
    """A hash as hex text, readable in a failure message (anything else as it is)."""
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash


def digest_as_bytes(model: str) -> dict[str, Any]:
    """The first block of a prompt, tokens [1, 2, 3, 4], with no parent (None)."""
    block_hash = hash_block_tokens(None, [1, 2, 3, 4])
    return {"type of hash_block_tokens(None, [1, 2, 3, 4])": type(block_hash).__name__,
            "its length": len(block_hash)}


def parent_changes_the_hash(model: str) -> dict[str, Any]:
    """Tokens [5, 6, 7, 8] hashed after the block [1, 2, 3, 4], and hashed as a
    first block; the same call twice.
    """
    first = hash_block_tokens(None, [1, 2, 3, 4])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    alone = hash_block_tokens(None, [5, 6, 7, 8])
    return {
        "hash_block_tokens(hash of [1, 2, 3, 4], [5, 6, 7, 8]) == hash_block_tokens(None, [5, 6, 7, 8])":
            second == alone,
        "hash_block_tokens(hash of [1, 2, 3, 4], [5, 6, 7, 8]), called twice: equal":
            hash_block_tokens(first, [5, 6, 7, 8]) == second,
    }


def first_block_uses_none_hash(model: str) -> dict[str, Any]:
    """Tokens [1, 2, 3, 4] with parent None, and with parent NONE_HASH."""
    return {"hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])":
            hash_block_tokens(None, [1, 2, 3, 4]) == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])}


def exact_hash_values(model: str) -> dict[str, Any]:
    """A chain of three blocks: [1, 2, 3, 4], then [5, 6, 7, 8], then token ids
    past 32 bits, [2**40, 0, 7, 2**31]; each hash shown as hex.
    """
    # Each call on its own line of the result: a packing that cannot hold 2**40
    # raises on the last block only, and the first two still show their values.
    first = hash_block_tokens(None, [1, 2, 3, 4])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    return {
        "hash_block_tokens(None, [1, 2, 3, 4])": _shown(first),
        "hash_block_tokens(<that hash>, [5, 6, 7, 8])": _shown(second),
        "hash_block_tokens(<that hash>, [2**40, 0, 7, 2**31])": _outcome(
            lambda: _shown(hash_block_tokens(second, [2**40, 0, 7, 2**31]))),
    }


# ------------------------------------------ 4.3 FreeKVCacheBlockQueue.remove
# Where each removal happens in the queue [0, 1, 2, 3, 4, 5]: middle, head, tail.
REMOVALS = ((2, "from the middle"), (0, "at the head"), (5, "at the tail"))


def _walk(queue: FreeKVCacheBlockQueue, forward: bool) -> list[int | str]:
    """The queue's block ids, from one sentinel towards the other.

    Walking backwards (``prev_free_block``) checks the links a forward walk
    never reads. A broken list may end early or loop, so the walk stops at a
    missing pointer or after more steps than there are blocks.
    """
    start, end = ((queue.fake_free_list_head, queue.fake_free_list_tail) if forward
                  else (queue.fake_free_list_tail, queue.fake_free_list_head))
    ids: list[int | str] = []
    node = start.next_free_block if forward else start.prev_free_block
    while node is not end:
        if node is None:
            return [*ids, "(a None pointer: the list is cut here)"]
        if len(ids) > 8:
            return [*ids, "(... the list loops)"]
        ids.append(node.block_id)
        node = node.next_free_block if forward else node.prev_free_block
    return ids


def _node_name(queue: FreeKVCacheBlockQueue, node: KVCacheBlock | None) -> int | str | None:
    """A block's id, or which sentinel it is (both sentinels have id -1)."""
    if node is queue.fake_free_list_head:
        return "head sentinel"
    if node is queue.fake_free_list_tail:
        return "tail sentinel"
    return None if node is None else node.block_id


def _queue_of_six() -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(6)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def unlinks_everywhere(model: str) -> dict[str, Any]:
    """The queue of blocks [0, 1, 2, 3, 4, 5]: remove block 2 (the middle), 0
    (the head) and 5 (the tail), walking the list both ways after each; then
    popleft() and append(block 2).
    """
    blocks, queue = _queue_of_six()
    result: dict[str, Any] = {}
    for block_id, where in REMOVALS:
        queue.remove(blocks[block_id])
        result[f"after remove(block {block_id}, {where}): head to tail"] = _walk(queue, forward=True)
        result[f"after remove(block {block_id}, {where}): tail to head"] = _walk(queue, forward=False)
    result["then popleft()"] = queue.popleft().block_id
    queue.append(blocks[2])
    result["then append(block 2): head to tail"] = _walk(queue, forward=True)
    result["then append(block 2): tail to head"] = _walk(queue, forward=False)
    return result


def counts_free_blocks(model: str) -> dict[str, Any]:
    """The queue of blocks [0, 1, 2, 3, 4, 5] (6 free): remove block 2, 0 and 5,
    then popleft() and append(block 2), reading num_free_blocks after each.
    """
    blocks, queue = _queue_of_six()
    result: dict[str, Any] = {}
    for block_id, where in REMOVALS:
        queue.remove(blocks[block_id])
        result[f"after remove(block {block_id}, {where}): num_free_blocks"] = queue.num_free_blocks
    queue.popleft()
    result["then popleft(): num_free_blocks"] = queue.num_free_blocks
    queue.append(blocks[2])
    result["then append(block 2): num_free_blocks"] = queue.num_free_blocks
    return result


def clears_pointers(model: str) -> dict[str, Any]:
    """The queue of blocks [0, 1, 2, 3, 4, 5]: remove block 2, 0 and 5, and read
    each removed block's (prev_free_block, next_free_block), as block ids
    (or which sentinel).
    """
    blocks, queue = _queue_of_six()
    result: dict[str, Any] = {}
    for block_id, where in REMOVALS:
        block = blocks[block_id]
        queue.remove(block)
        result[f"after remove(block {block_id}, {where}): its (prev, next)"] = (
            _node_name(queue, block.prev_free_block), _node_name(queue, block.next_free_block))
    return result


def rejects_blocks_not_in_queue(model: str) -> dict[str, Any]:
    """The queue of blocks [0, 1, 2, 3, 4, 5] without block 2: remove block 2
    again, then a block 9 that was never queued; the queue must be as it was.
    """
    blocks, queue = _queue_of_six()
    queue.remove(blocks[2])
    result: dict[str, Any] = {
        "remove(block 2), already removed": _outcome(lambda: queue.remove(blocks[2])),
        "remove(block 9), never in the queue": _outcome(lambda: queue.remove(KVCacheBlock(9))),
        "afterwards: head to tail": _walk(queue, forward=True),
        "afterwards: tail to head": _walk(queue, forward=False),
        "afterwards: num_free_blocks": queue.num_free_blocks,
    }
    return result


CHECKS: dict[str, tuple[Check, ...]] = {
    "4.1": (
        Check("returns only the new blocks, as a request grows", new_blocks_as_a_request_grows),
        Check("cache hits are claimed before new blocks are taken, so none is evicted", cache_hits_claimed_first),
        Check("all or nothing: no room changes nothing (cache hits included), an exact fit is admitted",
              all_or_nothing),
        Check("never more slots than max_model_len", capped_at_max_model_len),
        Check("only tokens that exist are hashed into the prefix cache", hashes_only_existing_tokens),
        Check("delay_cache_blocks keeps new blocks out of the prefix cache", delayed_caching),
        Check("with prefix caching off, nothing is cached", caching_disabled),
        Check("num_new_tokens < 1 is a ValueError", rejects_no_new_tokens),
        Check("end to end: prefix cache", e2e_prefix_cache),
        Check("end to end: preemption", e2e_preemption),
    ),
    "4.2": (
        Check("returns the SHA-256 digest as 32 bytes", digest_as_bytes),
        Check("chained: the parent's hash changes the result", parent_changes_the_hash),
        Check("the first block (parent None) is chained on NONE_HASH", first_block_uses_none_hash),
        Check("exact values: token ids packed as signed 64-bit little-endian", exact_hash_values),
        Check("end to end: prefix cache", e2e_prefix_cache),
    ),
    "4.3": (
        Check("unlinks from the middle, the head and the tail, both directions", unlinks_everywhere),
        Check("keeps num_free_blocks right", counts_free_blocks),
        Check("clears the removed block's pointers", clears_pointers),
        Check("a block not in the queue is a RuntimeError, and nothing changes", rejects_blocks_not_in_queue),
        Check("end to end: prefix cache", e2e_prefix_cache),
        Check("end to end: preemption", e2e_preemption),
    ),
}
