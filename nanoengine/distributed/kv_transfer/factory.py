"""The scheduler side of the connector ``kv_transfer_config.kv_connector`` names (chapters 5 and 10).

Torch-free, for ``nanoengine/core``; the worker side is picked in
``worker/kv_connector.py``, beside the tensors.
vLLM 0.32 counterpart: ``KVConnectorFactory`` in
``vllm/distributed/kv_transfer/kv_connector/factory.py`` (one registry for both roles).
"""

from __future__ import annotations

from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer.base import KVConnectorScheduler
from nanoengine.distributed.kv_transfer.shared_storage_scheduler import SharedStorageConnectorScheduler
from nanoengine.distributed.kv_transfer.zmq.scheduler import ZmqConnectorScheduler


def create_connector_scheduler(
    config: KVTransferConfig, block_size: int, tensor_parallel_size: int
) -> KVConnectorScheduler:
    if config.kv_connector == "ZmqConnector":
        return ZmqConnectorScheduler(config, block_size, tensor_parallel_size)
    return SharedStorageConnectorScheduler(config, block_size)
