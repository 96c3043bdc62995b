"""A KV connector in miniature: prefill/decode disaggregation on one machine.

Chapter 5 (engine skeleton) uses it to make WAITING_FOR_REMOTE_KVS real; chapter
8 (online serving) explains why one would split prefill and decode engines.
A *producer* engine saves the KV blocks of every prompt it prefills to shared
storage, keyed by block hash; a *consumer* engine finds a prompt's blocks there,
loads them on a thread while the request waits in WAITING_FOR_REMOTE_KVS, and
then computes only the rest. The connector is split as vLLM splits it:

* ``scheduler_side.py`` (no torch): which tokens can be loaded, which blocks
  to load into or save from -- decisions, carried to the worker in
  ``SchedulerOutput.kv_connector_metadata``;
* ``worker_side.py`` (torch): copies block tensors between the KV cache and
  the storage, and reports finished loads in ``ModelRunnerOutput``.

vLLM 0.32 counterpart: ``vllm/distributed/kv_transfer/kv_connector/v1/``
(``base.py``: ``KVConnectorBase_V1``, ``KVConnectorRole``, ``KVConnectorMetadata``;
the storage-directory example connector lives beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nanoengine.request import BlockHash


@dataclass
class BlockTransfer:
    """Copy these blocks of one request: ``block_hashes[i]`` <-> KV block ``block_ids[i]``."""

    req_id: str
    block_hashes: list[BlockHash]
    block_ids: list[int]


@dataclass
class KVConnectorMetadata:
    """One step's instructions from the scheduler side to the worker side."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


def block_file(storage_path: str, block_hash: BlockHash) -> Path:
    """Where one block's K and V live: one safetensors file per block hash.

    The hash chains every earlier block of the prompt (core/kv_cache_utils.py),
    so equal file names mean equal prefixes: the store is a prefix cache that
    outlives the engine that filled it.
    """
    return Path(storage_path) / f"{block_hash.hex()}.safetensors"
