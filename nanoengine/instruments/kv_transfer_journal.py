"""The KV transfer journal: what one engine did, step by step, for requests that crossed engines.

Chapter 10 (disaggregated prefill and decode). A request served by a prefill
engine and a decode engine leaves a trail in both: on the producer it
prefills, finishes, and its blocks stay held until the consumer has read
them; on the consumer it is offered the remote tokens, gets blocks, waits in
WAITING_FOR_REMOTE_KVS while the worker pulls, then computes the last prompt
token and decodes. The journal writes those moments down, in the engine
core's process, for every request that arrived with ``kv_transfer_params``.
The chapter-10 walkthrough fetches both engines' journals (utility calls
``watch_kv_transfers`` and ``kv_transfer_journal``) and prints them side by
side on one clock (``time.monotonic`` is one clock for all processes of a
Linux machine).

Everything is seen through method taps (``method_taps``): the scheduler and
its connector read as they do without a journal.

vLLM 0.32 counterpart: none; vLLM logs the same moments at debug level in
``nixl/pull_scheduler.py`` and counts them in ``KVConnectorStats``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from nanoengine.instruments.method_taps import tap

if TYPE_CHECKING:
    from nanoengine.core.sched.output import SchedulerOutput
    from nanoengine.core.sched.scheduler import Scheduler
    from nanoengine.distributed.kv_transfer.zmq.metadata import PullPlan
    from nanoengine.outputs import KVConnectorOutput
    from nanoengine.request import Request

# The journal keeps at most this many entries per engine (oldest dropped first).
MAX_ENTRIES = 2000


class JournalEntry(NamedTuple):
    """One moment: when (``time.monotonic()``), in which engine step, for which request, what,
    and how many KV blocks were in use (by requests, and by holds for a consumer) just after it."""

    at: float
    step: int
    request_id: str
    what: str
    num_used_blocks: int


class KVTransferJournal:
    """Taps one scheduler (and its connector) and writes down each moment of a crossing request."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.entries: list[JournalEntry] = []
        self.step = 0
        self._transfer_notes: list[tuple[str, str]] = []  # (request id, what), between the two taps
        # Requests whose first decode step is written down: the later ones are not
        # (a request's 100 decode steps would bury the few moments the chapter is about).
        self._decoding: set[str] = set()

    @classmethod
    def attach(cls, scheduler: Scheduler) -> KVTransferJournal:
        journal = cls(scheduler)
        connector = scheduler.connector
        tap(scheduler, "add_request", before=journal._on_arrive)
        tap(scheduler, "schedule", before=journal._on_step_begin, after=journal._on_schedule)
        tap(scheduler, "_start_remote_kv_load", after=journal._on_remote_load_started)
        # Read before the blocks go back (what was held), written down after (what is left).
        tap(scheduler, "_update_from_kv_xfer_finished", before=journal._read_transfers,
            after=journal._note_transfers)
        tap(scheduler, "_free_request", after=journal._on_free)
        if connector is not None:
            tap(connector, "get_num_new_matched_tokens", after=journal._on_offer)
        return journal

    def note(self, request_id: str, what: str, step: int | None = None) -> None:
        if len(self.entries) >= MAX_ENTRIES:
            del self.entries[0]
        manager = self.scheduler.kv_cache_manager
        used = manager.num_usable_blocks - manager.num_free_blocks
        self.entries.append(JournalEntry(time.monotonic(), self.step if step is None else step, request_id, what, used))

    def as_rows(self) -> list[tuple[float, int, str, str, int]]:
        """The entries as plain tuples: they cross the process boundary as msgpack."""
        return [tuple(entry) for entry in self.entries]  # type: ignore[misc]

    def _watched(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id) or self.scheduler.held_for_remote.get(request_id)
        return request is not None and bool(request.kv_transfer_params)

    # ---- the observers -------------------------------------------------------------

    def _on_arrive(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        role = ("do_remote_decode: prefill here, decode elsewhere" if params.get("do_remote_decode")
                else f"do_remote_prefill: its KV is on engine {str(params.get('remote_engine_id'))[:8]} "
                     f"as request {params.get('remote_request_id')}")
        # Between two steps: it is first seen by the next one.
        self.note(request.request_id, f"arrives: {request.num_prompt_tokens} prompt tokens, {role}", self.step + 1)

    def _on_offer(self, result: tuple[int, bool], request: Request, num_computed_tokens: int) -> None:
        num_external, load_async = result
        if (request.kv_transfer_params or {}).get("do_remote_prefill"):
            self.note(request.request_id, f"connector offers {num_external} remote tokens"
                                          f"{' (loaded async)' if load_async else ''} after "
                                          f"{num_computed_tokens} tokens of local prefix-cache hits")

    def _on_plan(self, plan: PullPlan) -> None:
        if plan.local_block_ids:
            self.note(plan.request_id, f"worker told: pull {len(plan.local_block_ids)} blocks, remote "
                                       f"{plan.remote_block_ids} into local {plan.local_block_ids}")
        else:
            self.note(plan.request_id, "worker told: nothing to pull, tell the producer to free its blocks")

    def _on_remote_load_started(self, started: bool, request: Request, *_: Any) -> None:
        if started:
            self.note(request.request_id, f"status {request.status.name}: the worker pulls on a thread")

    def _on_step_begin(self) -> None:
        self.step += 1

    def _on_schedule(self, output: SchedulerOutput) -> None:
        # The connector's instructions to the worker (the ZmqConnector's metadata has pulls).
        for plan in getattr(output.kv_connector_metadata, "reqs_to_recv", ()):
            self._on_plan(plan)
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            if not self._watched(request_id) or request_id in self._decoding:
                continue
            request = self.scheduler.requests[request_id]
            computed_after = request.num_computed_tokens  # schedule() already advanced it
            if computed_after > request.num_prompt_tokens:  # a decode step
                self._decoding.add(request_id)
                self.note(request_id, "first decode step (later ones not shown)")
            else:
                self.note(request_id, f"scheduled {num_tokens} prompt token(s): "
                                      f"{computed_after}/{request.num_prompt_tokens} computed after this step")

    def _read_transfers(self, output: KVConnectorOutput) -> None:
        stats = output.kv_connector_stats
        moved = "" if stats is None or not stats.num_transfers else (
            f": {stats.bytes_transferred / 1e6:.2f} MB in {stats.transfer_seconds * 1e3:.1f} ms")
        notes = self._transfer_notes
        for request_id in sorted(output.finished_recving):
            notes.append((request_id, f"worker: KV loaded{moved}; the request may be scheduled again"))
        for request_id in sorted(output.finished_sending):
            held = self.scheduler.held_for_remote.get(request_id)
            if held is not None:
                freed = _num_blocks(self.scheduler, held)
                notes.append((request_id, f"worker: blocks read by the consumer (or expired){moved}; {freed} blocks freed"))
        for request_id, reason in sorted(output.failed_recving.items()):
            notes.append((request_id, f"worker: KV load failed ({reason})"))

    def _note_transfers(self, _: None, output: KVConnectorOutput) -> None:
        for request_id, what in self._transfer_notes:
            self.note(request_id, what)
        self._transfer_notes.clear()

    def _on_free(self, kv_transfer_params: Mapping[str, Any] | None, request: Request) -> None:
        self._decoding.discard(request.request_id)
        if not request.kv_transfer_params:
            return
        status = request.status.name
        if request.request_id in self.scheduler.held_for_remote:
            blocks = (kv_transfer_params or {}).get("remote_block_ids")
            self.note(request.request_id, f"{status}; connector: delay_free_blocks=True, "
                                          f"blocks {blocks} held for the consumer")
        else:
            self.note(request.request_id, f"{status}; blocks freed")


def _num_blocks(scheduler: Scheduler, request: Request) -> int:
    return sum(len(ids) for ids in scheduler.kv_cache_manager.get_block_ids(request.request_id))
