"""The worker half of the shared-storage KV connector: copy block tensors.

Chapter 5. Loads run on a thread of their own, so the engine keeps stepping
other requests while a consumer's request waits in WAITING_FOR_REMOTE_KVS;
``get_finished`` reports the loads that completed, and the scheduler promotes
those requests. Saves run right after the forward pass that wrote the blocks
(``wait_for_save``). One file per block: ``kv`` of shape [num_layers, 2,
block_size, num_kv_heads, head_dim], the block's slice of every layer's cache.
vLLM 0.32 counterpart: the worker-role methods of ``ExampleConnector``
(``start_load_kv``, ``wait_for_save``, ``get_finished``) in
``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from safetensors.torch import load_file, save_file

from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer import BlockTransfer, SharedStorageConnectorMetadata, block_file
from nanoengine.distributed.kv_transfer.base import KVConnectorMetadata, KVConnectorWorker


class SharedStorageConnectorWorker(KVConnectorWorker):
    """Moves KV blocks between the cache tensors and the storage directory."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        os.makedirs(config.shared_storage_path, exist_ok=True)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoengine-kv-load")
        self._loading: dict[str, Future[None]] = {}
        self.kv_caches: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads in the background and return at once."""
        assert isinstance(metadata, SharedStorageConnectorMetadata)
        for transfer in metadata.loads:
            self._loading[transfer.req_id] = self._loader.submit(self._load, transfer)

    def _load(self, transfer: BlockTransfer) -> None:
        for block_hash, block_id in zip(transfer.block_hashes, transfer.block_ids):
            kv = load_file(block_file(self.config.shared_storage_path, block_hash))["kv"]
            for layer, cache in enumerate(self.kv_caches):  # cache: [2, num_blocks, block_size, heads, dim]
                cache[:, block_id].copy_(kv[layer])

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """Write the planned blocks; a block already stored (same hash) is skipped."""
        assert isinstance(metadata, SharedStorageConnectorMetadata)
        for transfer in metadata.saves:
            for block_hash, block_id in zip(transfer.block_hashes, transfer.block_ids):
                path = block_file(self.config.shared_storage_path, block_hash)
                if path.exists():
                    continue
                kv = torch.stack([cache[:, block_id] for cache in self.kv_caches]).contiguous()
                # Write then rename: a reader never sees half a file.
                partial = path.with_suffix(".partial")
                save_file({"kv": kv}, str(partial))
                os.replace(partial, path)

    def wait_for_finished_requests(self, finished_req_ids: set[str]) -> None:
        """Let loads of requests that ended (aborted) complete before their blocks are reused.

        The scheduler may hand those blocks to another request in this very
        step; a late write from the load thread would corrupt that request's KV.
        """
        for req_id in finished_req_ids & self._loading.keys():
            self._loading.pop(req_id).exception()  # waits; a failure no longer matters

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(nothing is ever sent, the ids whose load completed); a failed load raises here."""
        done = {req_id for req_id, future in self._loading.items() if future.done()}
        for req_id in done:
            self._loading.pop(req_id).result()
        return set(), done

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
