"""What every KV connector answers: the scheduler half and the worker half.

Chapters 5 and 10. A KV connector lets one engine use KV blocks that another
engine computed. vLLM splits each connector into two roles that live in
different places, and so does nanoengine:

* the **scheduler side** runs in the engine core next to the scheduler and
  never touches a tensor: it decides how many prompt tokens can be loaded
  instead of computed, which blocks to fill or hold, and what to tell the
  worker each step (``KVConnectorMetadata`` inside ``SchedulerOutput``);
* the **worker side** runs next to the KV cache tensors (on every
  tensor-parallel rank) and moves the bytes, reporting back in
  ``ModelRunnerOutput.kv_connector_output`` what finished.

This module is torch-free so that ``nanoengine/core`` can import it.

vLLM 0.32 counterpart: ``KVConnectorBase_V1``, ``KVConnectorRole`` and
``KVConnectorMetadata`` in ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``.
vLLM has one class with a role argument; nanoengine has one class per role,
so the scheduler's half imports no torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nanoengine.request import Request


class KVConnectorMetadata:
    """One step's instructions from the scheduler side to the worker side (each connector subclasses it)."""

    def __bool__(self) -> bool:
        return False


@dataclass
class KVTransferStats:
    """Counters of one engine's transfers, cumulative (``/metrics``, chapter 10).

    The worker side counts what it did since the last step; the scheduler adds
    the steps up (``add``). A consumer counts what it read, a producer what it
    sent and the holds that expired.
    """

    num_transfers: int = 0  # pulls that completed (consumer) or reads served (producer)
    bytes_transferred: int = 0
    transfer_seconds: float = 0.0  # summed over transfers
    num_failed_transfers: int = 0
    num_expired_holds: int = 0  # producer: blocks freed because no consumer came in time

    def add(self, other: KVTransferStats) -> None:
        self.num_transfers += other.num_transfers
        self.bytes_transferred += other.bytes_transferred
        self.transfer_seconds += other.transfer_seconds
        self.num_failed_transfers += other.num_failed_transfers
        self.num_expired_holds += other.num_expired_holds

    def __bool__(self) -> bool:
        return bool(self.num_transfers or self.num_failed_transfers or self.num_expired_holds)


class KVConnectorScheduler(ABC):
    """The scheduler side (vLLM's scheduler-role methods of ``KVConnectorBase_V1``)."""

    def validate_request(self, kv_transfer_params: dict[str, Any], num_prompt_tokens: int) -> None:
        """Refuse, with a ValueError naming the field, a request this connector cannot serve.

        Called by the front end's ``InputProcessor``, before a server answers
        200, so a bad request gets a 400; the default accepts everything.
        """

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens beyond ``num_computed_tokens`` that can be loaded, whether the load is async).

        An async load blocks the request in WAITING_FOR_REMOTE_KVS until the
        worker reports it finished; both of nanoengine's connectors load that way.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """Blocks now exist for the matched tokens (``block_ids``, one list per KV cache group): plan the load.

        Called with ``num_external_tokens == 0`` too, when nothing is to be
        loaded, so a connector can let go of what it reserved elsewhere.
        """

    @abstractmethod
    def build_connector_meta(
        self,
        requests: Mapping[str, Request],
        num_scheduled_tokens: Mapping[str, int],
        get_block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> KVConnectorMetadata:
        """This step's instructions for the worker side (called at the end of ``schedule()``)."""

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request ended: (keep its blocks for a while?, ``kv_transfer_params`` for the client).

        ``True`` is vLLM's ``delay_free_blocks``: the scheduler frees the blocks
        only when the worker reports them sent (``finished_sending``). The
        default frees at once and returns nothing.
        """
        return False, None


class KVConnectorWorker(ABC):
    """The worker side (vLLM's worker-role methods of ``KVConnectorBase_V1``).

    Both of nanoengine's connectors move whole requests, before or after the
    forward pass, so the per-layer pair of vLLM's interface
    (``wait_for_layer_load``, ``save_kv_layer``) is not part of this one: in
    vLLM's pull-mode NixlConnector those are empty too.
    """

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[Any]) -> None:
        """The KV cache tensors, once allocated: one [2, num_blocks, block_size, heads, head_dim] per layer."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads in the background and return at once."""

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After the forward pass: write out what this step's metadata says to save (default: nothing)."""

    @abstractmethod
    def wait_for_finished_requests(self, finished_req_ids: set[str]) -> None:
        """Requests that ended in the scheduler: stop their loads before their blocks are reused."""

    @abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""

    def get_load_errors(self) -> dict[str, str]:
        """Request id -> why its load failed, since the last call (default: none fail)."""
        return {}

    def get_kv_connector_stats(self) -> KVTransferStats | None:
        """What moved since the last call; None when this connector counts nothing."""
        return None

    def shutdown(self) -> None:
        """Stop threads and close sockets (default: nothing to stop)."""
