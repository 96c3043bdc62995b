"""The model runner's side of a KV connector: build it, and report what it finished.

Chapters 5 and 10. The runner calls the worker half of the connector at three
points of a step (``model_runner.py``): ``start_load_kv`` before the forward
pass, ``wait_for_save`` after it, and ``get_finished`` whenever it answers
the engine; ``kv_connector_output`` packs the answers for the scheduler.
vLLM 0.32 counterpart: ``vllm/v1/worker/kv_connector_model_runner_mixin.py``
(``KVConnectorModelRunnerMixin``) and the worker role of ``KVConnectorFactory``.
"""

from __future__ import annotations

from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer.base import KVConnectorWorker
from nanoengine.distributed.kv_transfer.shared_storage_worker import SharedStorageConnectorWorker
from nanoengine.distributed.kv_transfer.zmq.worker import ZmqConnectorWorker
from nanoengine.outputs import KVConnectorOutput


def create_connector_worker(config: KVTransferConfig, rank: int) -> KVConnectorWorker:
    """The worker half of ``config.kv_connector`` for tensor-parallel rank ``rank``."""
    if config.kv_connector == "ZmqConnector":
        return ZmqConnectorWorker(config, rank)
    return SharedStorageConnectorWorker(config)


def kv_connector_output(connector: KVConnectorWorker) -> KVConnectorOutput:
    """Everything the connector finished since the last step, for ``ModelRunnerOutput``."""
    finished_sending, finished_recving = connector.get_finished()
    return KVConnectorOutput(
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=connector.get_load_errors(),
        kv_connector_stats=connector.get_kv_connector_stats(),
    )
