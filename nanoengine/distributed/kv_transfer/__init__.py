"""KV connectors: one engine uses KV blocks another engine computed.

Chapter 5 meets WAITING_FOR_REMOTE_KVS through the smallest connector, and
chapter 10 splits prefill and decode over two servers with a real one:

* ``SharedStorageConnector`` (``shared_storage_*.py``): a *producer* engine
  saves the KV blocks of every prompt it prefills to a directory, keyed by
  block hash; a *consumer* engine finds a prompt's blocks there and loads them
  on a thread while the request waits in WAITING_FOR_REMOTE_KVS. One machine.
* ``ZmqConnector`` (``zmq/``): the prefill server holds a finished prompt's
  blocks and tells the client where they are (``kv_transfer_params``); the
  decode server pulls exactly the blocks it lacks over TCP (pyzmq) and decodes.
  Two servers, on one host or two, stitched together by a proxy
  (``nanoengine/entrypoints/disagg_proxy.py``).

Each connector is split as vLLM splits it (``base.py``): a torch-free
scheduler side that decides, and a worker side that moves tensors;
``factory.py`` picks the scheduler side by name.

vLLM 0.32 counterpart: ``vllm/distributed/kv_transfer/kv_connector/v1/``
(``base.py``; ``example_connector.py`` is the storage one; ``nixl/`` the
network one whose ``kv_transfer_params`` the ZmqConnector speaks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nanoengine.distributed.kv_transfer.base import KVConnectorMetadata
from nanoengine.request import BlockHash


@dataclass
class BlockTransfer:
    """Copy these blocks of one request: ``block_hashes[i]`` <-> KV block ``block_ids[i]``."""

    req_id: str
    block_hashes: list[BlockHash]
    block_ids: list[int]


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    """The storage connector's step: blocks to load from files, blocks to save to them."""

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
