"""What the ZmqConnector's scheduler side tells its worker side, and what goes on the wire.

Chapter 10. The producer (prefill server) *holds* the blocks of a finished
prefill; the consumer (decode server) *pulls* the ones it lacks, or *releases*
them when it will not read them (its request was aborted, or its own prefix
cache already had everything).

On the wire, between a consumer rank and the producer rank of the same number:

* the consumer sends one frame, a msgpack ``PullRequest``;
* the producer answers a read with a msgpack ``PullReply`` frame followed by
  one frame per layer: that layer's K and V of the asked blocks, the bytes of
  a [2, num_blocks, block_size, num_kv_heads, head_dim] tensor. A release gets
  no answer.

vLLM 0.32 counterpart: ``nixl/metadata.py`` (``ReqMeta``, ``NixlConnectorMetadata``);
NIXL moves the bytes with RDMA or UCX instead of a message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from nanoengine.distributed.kv_transfer.base import KVConnectorMetadata


@dataclass
class PullPlan:
    """Consumer: read ``remote_block_ids`` of a producer's request into ``local_block_ids``.

    Empty block lists mean "read nothing, release them": the producer frees
    its blocks at once instead of after its abort timeout.
    """

    request_id: str  # this engine's id, reported back in finished_recving
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int  # rank 0's port; rank r pulls from remote_port + r
    local_block_ids: list[int]
    remote_block_ids: list[int]


@dataclass
class ZmqConnectorMetadata(KVConnectorMetadata):
    """One step's instructions for every rank's worker side."""

    # Consumer: pulls to start (and releases to send) this step.
    reqs_to_recv: list[PullPlan] = field(default_factory=list)
    # Producer: request id -> block ids of finished prefills to hold from now on.
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.reqs_to_recv or self.reqs_to_send)


class PullRequest(msgspec.Struct):
    """Consumer -> producer: ``op`` is "read" or "release"."""

    op: str
    request_id: str  # the producer's id of the request
    engine_id: str  # the producer the consumer means: a restarted one has another
    block_ids: list[int]


class PullReply(msgspec.Struct):
    """Producer -> consumer, before the layer frames: what follows, or why nothing does."""

    ok: bool
    error: str = ""
    dtype: str = ""
    shape: list[int] = []  # of each layer frame: [2, num_blocks, block_size, heads, head_dim]
