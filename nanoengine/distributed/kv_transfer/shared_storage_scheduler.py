"""The scheduler half of the shared-storage KV connector: decide, never touch tensors.

Chapter 5. The scheduler asks two questions of it while admitting a waiting
request -- how many more prompt tokens can be loaded instead of computed
(``get_num_new_matched_tokens``), and, once blocks are allocated, records which
blocks to fill (``update_state_after_alloc``). After each ``schedule()`` it
packs the step's loads and saves for the worker (``build_connector_meta``).
Pure Python: ``nanoengine/core`` imports it.
vLLM 0.32 counterpart: the scheduler-role methods of ``ExampleConnector`` in
``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer import BlockTransfer, SharedStorageConnectorMetadata, block_file
from nanoengine.distributed.kv_transfer.base import KVConnectorScheduler
from nanoengine.kv_cache_interface import FULL_ATTENTION_GROUP
from nanoengine.request import Request


class SharedStorageConnectorScheduler(KVConnectorScheduler):
    """Matches prompts against the storage directory and plans block copies."""

    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._pending_loads: list[BlockTransfer] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose KV the storage holds; loaded async.

        Whole blocks only, and never the last prompt token: its forward pass
        produces the logits of the first output token, so it is always computed
        here (the same rule as a local prefix-cache hit).
        """
        if not self.config.is_consumer:
            return 0, False
        max_blocks = (request.num_tokens - 1) // self.block_size
        num_blocks = 0
        while (
            num_blocks < max_blocks
            and block_file(self.config.shared_storage_path, request.block_hashes[num_blocks]).exists()
        ):
            num_blocks += 1
        num_external = max(num_blocks * self.block_size - num_computed_tokens, 0)
        return num_external, num_external > 0

    def update_state_after_alloc(
        self,
        request: Request,
        block_ids: tuple[list[int], ...],
        num_computed_tokens: int,
        num_external_tokens: int,
    ) -> None:
        """Blocks now exist for the matched tokens: plan the load into them.

        ``block_ids`` has one list per KV cache group; the stored files hold
        full-attention K/V, so only that group's blocks are filled.
        """
        if num_external_tokens == 0:
            return
        first = num_computed_tokens // self.block_size
        last = (num_computed_tokens + num_external_tokens) // self.block_size
        table = block_ids[FULL_ATTENTION_GROUP]
        self._pending_loads.append(
            BlockTransfer(request.request_id, request.block_hashes[first:last], table[first:last])
        )

    def build_connector_meta(
        self,
        requests: Mapping[str, Request],
        num_scheduled_tokens: Mapping[str, int],
        get_block_ids: Callable[[str], tuple[list[int], ...]],
    ) -> SharedStorageConnectorMetadata:
        """This step's loads (planned since the last step) and saves.

        A producer saves a prompt's full blocks in the step that completes its
        prefill: the forward pass writes their K/V, the worker copies them out
        right after, before the blocks could be freed or reused.
        """
        metadata = SharedStorageConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.config.is_producer:
            return metadata
        for req_id, num_scheduled in num_scheduled_tokens.items():
            request = requests[req_id]
            # num_computed_tokens already includes this step (optimistic count).
            completes_prompt = (
                request.num_computed_tokens - num_scheduled
                < request.num_prompt_tokens
                <= request.num_computed_tokens
            )
            num_full_blocks = request.num_prompt_tokens // self.block_size
            if completes_prompt and num_full_blocks > 0:
                block_ids = get_block_ids(req_id)[FULL_ATTENTION_GROUP][:num_full_blocks]
                metadata.saves.append(
                    BlockTransfer(req_id, request.block_hashes[:num_full_blocks], block_ids)
                )
        return metadata
