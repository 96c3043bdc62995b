"""The ZmqConnector's scheduler side: who holds, who pulls, and what the client is told.

Chapter 10. One request crosses two engines, told apart by ``kv_transfer_params``
(the names and meanings of vLLM's NixlConnector, so vLLM's proxy works unchanged):

1. **On the producer** the request arrives with ``{"do_remote_decode": true}``
   and ``max_tokens: 1``. It prefills as any request. When it finishes,
   ``request_finished`` answers ``delay_free_blocks=True``: the scheduler keeps
   its blocks, and the client gets ``kv_transfer_params`` saying where they
   are (``remote_host``, ``remote_port``, ``remote_engine_id``,
   ``remote_request_id``, ``remote_block_ids``, ``tp_size``). The worker side
   frees them once a consumer has read them, or after
   ``abort_request_timeout_s``.
2. **On the consumer** the same prompt arrives with those params and
   ``do_remote_prefill: true``. ``get_num_new_matched_tokens`` offers every
   prompt token past the local prefix-cache hits except the last; the
   scheduler allocates blocks, ``update_state_after_alloc`` plans the pull of
   exactly the blocks after the local hits, and the request waits in
   WAITING_FOR_REMOTE_KVS until the worker has them. The last prompt token is
   then computed here, and its logits give the first output token.

vLLM 0.32 counterpart: ``nixl/pull_scheduler.py`` (with ``nixl/base_scheduler.py``).
vLLM offers the whole prompt and, once loaded, takes one token back
(``_update_waiting_for_remote_kv``); offering one token less up front is the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer.base import KVConnectorScheduler
from nanoengine.distributed.kv_transfer.zmq.metadata import PullPlan, ZmqConnectorMetadata
from nanoengine.exceptions import ValidationError
from nanoengine.kv_cache_interface import FULL_ATTENTION_GROUP
from nanoengine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# What a consumer's kv_transfer_params must hold, with each value's type.
_REMOTE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_host": str,
    "remote_port": int,
    "remote_block_ids": list,
    "tp_size": int,
}
# A prefill that ended this way left valid KV for its whole prompt.
_FINISHED_WITH_KV = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _refusal(message: str) -> ValidationError:
    return ValidationError(message, parameter="kv_transfer_params")


class ZmqConnectorScheduler(KVConnectorScheduler):
    """Plans holds (producer) and pulls (consumer); the worker side carries them out."""

    def __init__(self, config: KVTransferConfig, block_size: int, tensor_parallel_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.tensor_parallel_size = tensor_parallel_size
        # Collected between two schedule() calls, handed to the worker by the next.
        self._reqs_need_recv: list[PullPlan] = []
        self._reqs_need_send: dict[str, list[int]] = {}

    # ---- a request arrives --------------------------------------------------

    def validate_request(self, kv_transfer_params: dict[str, Any], num_prompt_tokens: int) -> None:
        """Refuse params this engine cannot act on, naming the field and the limit."""
        params = kv_transfer_params
        if params.get("do_remote_decode") and not self.config.is_producer:
            raise _refusal(f"kv_transfer_params.do_remote_decode needs a kv_producer engine; "
                           f"this one is {self.config.kv_role}.")
        if not params.get("do_remote_prefill"):
            return
        if not self.config.is_consumer:
            raise _refusal(f"kv_transfer_params.do_remote_prefill needs a kv_consumer engine; "
                           f"this one is {self.config.kv_role}.")
        for name, kind in _REMOTE_FIELDS.items():
            value = params.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise _refusal(f"kv_transfer_params.{name} must be a {getattr(kind, '__name__', kind)}, "
                               f"got {value!r:.200}.")
        if params["tp_size"] != self.tensor_parallel_size:
            raise _refusal(
                f"kv_transfer_params.tp_size: the prefill engine has tensor_parallel_size={params['tp_size']}, "
                f"this decode engine has {self.tensor_parallel_size}; both sides must be the same size."
            )
        blocks = params["remote_block_ids"]
        needed = -(-(num_prompt_tokens - 1) // self.block_size)
        if len(blocks) < needed or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0
                                           for b in blocks):
            raise _refusal(f"kv_transfer_params.remote_block_ids must be at least {needed} block ids for a "
                           f"{num_prompt_tokens}-token prompt, got {blocks!r:.200}.")

    # ---- consumer ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Every prompt token past the local hits but the last one, loaded async; 0 without params."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = max(request.num_prompt_tokens - 1 - num_computed_tokens, 0)
        return count, count > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_computed_tokens: int, num_external_tokens: int
    ) -> None:
        """Plan the pull of the blocks after the local hits (or, with nothing to pull, the release).

        Local hits are whole blocks, so block ``i`` of the request is block
        ``i`` on both sides; ``first`` is the first one the consumer lacks.
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # once: a later admission must not pull again
        first = num_computed_tokens // self.block_size
        last = -(-(num_computed_tokens + num_external_tokens) // self.block_size) if num_external_tokens else first
        local = block_ids[FULL_ATTENTION_GROUP][first:last] if block_ids else []
        self._reqs_need_recv.append(self._plan(request.request_id, params, local, params["remote_block_ids"][first:last]))

    def _plan(self, request_id: str, params: dict[str, Any], local: list[int], remote: list[int]) -> PullPlan:
        return PullPlan(request_id, params["remote_request_id"], params["remote_engine_id"],
                        params["remote_host"], params["remote_port"], list(local), list(remote))

    # ---- every step ---------------------------------------------------------------

    def build_connector_meta(
        self,
        requests: Mapping[str, Request],
        num_scheduled_tokens: Mapping[str, int],
        get_block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> ZmqConnectorMetadata:
        """The pulls planned and the holds begun since the last step (the step itself adds none)."""
        metadata = ZmqConnectorMetadata(self._reqs_need_recv, self._reqs_need_send)
        self._reqs_need_recv, self._reqs_need_send = [], {}
        return metadata

    # ---- a request ends ---------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Producer: hold a finished prefill's blocks and say where they are. Consumer: release unread ones.

        A consumer request that ends with ``do_remote_prefill`` still set never
        got as far as a pull (aborted while queued): the producer is told to
        free its blocks now rather than when its timeout runs out.
        """
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            params["do_remote_prefill"] = False
            self._reqs_need_recv.append(self._plan(request.request_id, params, [], []))
            return False, None
        blocks = block_ids[FULL_ATTENTION_GROUP] if block_ids else []
        if not params.get("do_remote_decode") or request.status not in _FINISHED_WITH_KV or not blocks:
            return False, None
        self._reqs_need_send[request.request_id] = list(blocks)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(blocks),
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.config.kv_ip,
            "remote_port": self.config.kv_port,
            "tp_size": self.tensor_parallel_size,
        }
