"""Frames: one engine step as plain JSON data, the unit the live view draws.

Chapters 3 (scheduler), 4 (KV cache manager), 5 (engine skeleton) and 9
(speculative decoding), seen in a browser. The step tracer
(``nanoengine/instruments/trace/``) already writes down what a step decided;
a frame adds the state the step left behind, read off the scheduler at the
end of ``update_from_output``:

* ``blocks``: every block of the pool in one of three kinds -- held by
  requests (``held``: request id -> its block ids, and ``shared``: the ref
  count of a block more than one table holds, a prefix hit), free but still
  cached (``cached_free``: ``[block id, hash prefix]`` in the free queue's
  order, the first one evicted first), or free and empty (all the others);
* ``requests``: each live request's state (one of the 12 of
  ``RequestStatus``) with its tokens computed and still to compute;
* ``counts``: the totals the page prints, requests per state included (a
  finished state counts the requests that reached it since the feed began);
* the step itself: its chunks against the token budget, preemptions,
  evictions, prefix hits, drafts and accepted drafts, its time.

A trace file (the docs site's replays) is a list of frames in an envelope
with a format name and a version (``trace_document``); ``check_trace_document``
refuses a wrong version or a broken file with a message saying which, as the
page's viewer does.

vLLM 0.32 counterpart: none. vLLM publishes the block-level facts as KV cache
events (``BlockStored``, ``BlockRemoved`` in ``vllm/distributed/kv_events.py``)
and the counts as ``SchedulerStats``; a frame is both, once per step.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from nanoengine.request import RequestStatus

if TYPE_CHECKING:
    from nanoengine.core.block_pool import BlockPool
    from nanoengine.core.sched.scheduler import Scheduler
    from nanoengine.instruments.trace.data import StepTrace
    from nanoengine.request import Request

# The envelope of a trace file; the viewer checks both before it draws.
TRACE_FORMAT = "nanoengine-step-trace"
TRACE_VERSION = 1
# The 12 states, in vLLM's order: the page lists them in this order.
STATE_NAMES = tuple(status.name for status in RequestStatus)
# A block's hash is 32 bytes; the page shows this many hex digits of it.
HASH_DIGITS = 8
# Above this many blocks the free queue is not walked for its order (a walk
# costs about 0.2 µs a block, every step): the cached free blocks are then
# listed by id, and ``lru_order`` says so.
LRU_WALK_MAX_BLOCKS = 8192


def build_frame(scheduler: Scheduler, step: StepTrace, finished_so_far: Counter[str], started_at: float) -> dict[str, Any]:
    """The frame of ``step``: what it decided (from the tracer) and the state it left."""
    manager = scheduler.kv_cache_manager
    blocks = block_snapshot(manager.block_pool, _block_tables(scheduler))
    requests = [request_row(request) for request in scheduler.requests.values()]
    states = Counter(row["state"] for row in requests)
    states.update(finished_so_far)
    # After update_from_output: finished requests are gone, their blocks free.
    num_running, num_waiting = scheduler.get_request_counts()
    return {
        "step": step.step,
        "t": round(time.monotonic() - started_at, 4),
        "step_ms": round((step.schedule_s + step.execute_s + step.update_s) * 1e3, 3),
        "budget": scheduler.max_num_scheduled_tokens,
        "block_size": scheduler.block_size,
        "scheduled": [asdict(chunk) for chunk in step.scheduled],
        "preemptions": [asdict(p) for p in step.preemptions],
        "arrived": list(step.arrived),
        "finished": dict(step.finished),
        "evicted": list(step.evicted_block_ids),
        "tokens_out": sum(_num_sampled(chunk.start, chunk.num_tokens, chunk.num_prompt_tokens,
                                       chunk.num_accepted_tokens) for chunk in step.scheduled),
        "blocks": blocks,
        "requests": requests,
        "counts": {
            "free": blocks["num_free"] - len(blocks["cached_free"]),
            "cached": len(blocks["cached_free"]),
            "held": blocks["num_held"],
            "running": num_running,
            "waiting": num_waiting,
            "states": {name: states.get(name, 0) for name in STATE_NAMES},
        },
        "kv_usage": round(manager.usage, 4),
        "prefix_cache": {"queries": step.prefix_cache_queries, "hits": step.prefix_cache_hits},
    }


def block_snapshot(pool: BlockPool, tables: dict[str, list[int]]) -> dict[str, Any]:
    """The pool's blocks by kind: held (per request), shared (ref count > 1), cached but free.

    ``tables`` maps each request to its blocks in every KV cache group (the
    pool's view, as the tracer keeps it). The null block (block 0, never
    handed out) is named so the page can grey it out.
    """
    # Keys as strings: a frame crosses processes as msgpack and reaches the page as JSON.
    shared = {str(block_id): pool.blocks[block_id].ref_cnt for ids in tables.values() for block_id in ids
              if pool.blocks[block_id].ref_cnt > 1}
    walk_in_order = pool.num_blocks <= LRU_WALK_MAX_BLOCKS
    free = (pool.free_block_queue.get_all_free_blocks() if walk_in_order
            else sorted((b for b in pool.cached_block_hash_to_block.values() if b.ref_cnt == 0),
                        key=lambda b: b.block_id))
    cached_free = [[block.block_id, block.block_hash.hex()[:HASH_DIGITS]]
                   for block in free if block.block_hash is not None]
    return {
        "num_blocks": pool.num_blocks,
        "null_block": pool.null_block.block_id,
        "num_free": pool.free_block_queue.num_free_blocks,
        "num_held": pool.num_usable_blocks - pool.free_block_queue.num_free_blocks,
        "held": tables,
        "shared": shared,
        "cached_free": cached_free,
        "lru_order": walk_in_order,
    }


def request_row(request: Request) -> dict[str, Any]:
    """One live request as the page lists it."""
    return {
        "id": request.request_id,
        "state": request.status.name,
        "computed": request.num_computed_tokens,
        "tokens": request.num_tokens,
        "prompt": request.num_prompt_tokens,
        "output": request.num_output_tokens,
        "max_tokens": request.max_tokens,
    }


def _block_tables(scheduler: Scheduler) -> dict[str, list[int]]:
    """Request id -> the blocks it holds, every group's table in group order.

    Requests held for a consumer (chapter 10) hold blocks too, so they count.
    """
    coordinator = scheduler.kv_cache_manager.coordinator
    tables: dict[str, list[int]] = {}
    for manager in coordinator.single_type_managers:
        for request_id, blocks in manager.req_to_blocks.items():
            tables.setdefault(request_id, []).extend(block.block_id for block in blocks)
    return {request_id: ids for request_id, ids in tables.items() if ids}


def _num_sampled(start: int, num_tokens: int, num_prompt_tokens: int, num_accepted: int) -> int:
    """Tokens a chunk produced: none for a prefill chunk short of the prompt's end,
    else one, plus the drafts the target kept (chapter 9)."""
    return 0 if start + num_tokens < num_prompt_tokens else 1 + num_accepted


def trace_document(frames: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """A trace file's contents: the envelope, what was run (``meta``) and the frames."""
    return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": meta, "frames": frames}


def check_trace_document(document: object) -> list[dict[str, Any]]:
    """The frames of a trace file, or ``ValueError`` naming what is wrong with it."""
    if not isinstance(document, dict) or document.get("format") != TRACE_FORMAT:
        raise ValueError(f"not a nanoengine step trace: expected format {TRACE_FORMAT!r}")
    version = document.get("version")
    if version != TRACE_VERSION:
        raise ValueError(f"trace version {version!r}, but this viewer reads version {TRACE_VERSION}")
    frames = document.get("frames")
    if not isinstance(frames, list) or not frames:
        raise ValueError("the trace has no frames")
    for index, frame in enumerate(frames):
        missing = [key for key in ("step", "blocks", "counts", "scheduled") if not isinstance(frame, dict)
                   or key not in frame]
        if missing:
            raise ValueError(f"frame {index} lacks {', '.join(missing)}")
    return frames
