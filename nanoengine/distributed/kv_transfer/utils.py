"""One ``KVConnectorOutput`` from every rank's: a request is done when all ranks are done.

Chapter 10, with tensor parallelism (chapter 6). Each rank moves its own slice
of a request's blocks (its KV heads) and finishes when its own transfer does,
so rank 0's word alone is not enough: the consumer must not compute on blocks
whose rank-1 slice is still arriving, and the producer must not free blocks a
rank is still sending. The executor asks every rank and merges the answers here.
vLLM 0.32 counterpart: ``KVOutputAggregator`` in
``vllm/distributed/kv_transfer/kv_connector/utils.py``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from nanoengine.distributed.kv_transfer.base import KVTransferStats
from nanoengine.outputs import KVConnectorOutput, ModelRunnerOutput


class KVOutputAggregator:
    """Counts each request's reports across ranks between steps."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        # A load that failed on some rank: the first reason, kept until every rank has reported.
        self._failures: dict[str, str] = {}

    def aggregate(self, outputs: list[ModelRunnerOutput | None]) -> ModelRunnerOutput | None:
        """Rank 0's output, with the connector fields merged over ``outputs`` (one per rank)."""
        first = outputs[0]
        if first is None:
            return None  # sampling deferred on every rank alike
        merged = KVConnectorOutput()
        stats = KVTransferStats()
        for output in outputs:
            assert output is not None
            kv = output.kv_connector_output
            if kv is None:
                continue
            merged.finished_sending |= self._complete(self._sending, kv.finished_sending)
            for req_id, reason in kv.failed_recving.items():
                self._failures.setdefault(req_id, reason)
            for req_id in self._complete(self._recving, kv.finished_recving | set(kv.failed_recving)):
                if req_id in self._failures:
                    merged.failed_recving[req_id] = self._failures.pop(req_id)
                else:
                    merged.finished_recving.add(req_id)
            if kv.kv_connector_stats is not None:
                stats.add(kv.kv_connector_stats)
        merged.kv_connector_stats = stats if stats else None
        return replace(first, kv_connector_output=merged)

    def _complete(self, counts: Counter[str], req_ids: set[str]) -> set[str]:
        """Count one more rank for each id; the ids that every rank has now reported."""
        done = set()
        for req_id in req_ids:
            counts[req_id] += 1
            if counts[req_id] == self.world_size:
                del counts[req_id]
                done.add(req_id)
        return done
