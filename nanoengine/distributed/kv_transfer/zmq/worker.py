"""The ZmqConnector's worker side: a block server on the producer, pulls on the consumer.

Chapter 10. Every tensor-parallel rank runs its own half: rank ``r`` of the
producer serves its slice of each block (its KV heads) on ``kv_port + r``, and
rank ``r`` of the consumer pulls from it, so a transfer needs the same TP size
on both sides (the scheduler side checks ``tp_size``).

* **Producer.** A thread owns a ZMQ ROUTER socket. The engine registers the
  blocks it holds (``start_load_kv`` reads ``reqs_to_send``); a consumer's
  read is answered with the K/V of the asked blocks, one frame per layer, and
  the hold ends (``finished_sending``: the scheduler frees the blocks). A hold
  nobody reads ends after ``abort_request_timeout_s``; a release ends it at once.
  The server thread is critical: if it dies, the next ``get_finished`` raises
  its error, the step fails and the engine dies loudly, instead of holding
  blocks that no consumer can ever read.
* **Consumer.** Each pull runs on a thread of a small pool with a DEALER
  socket of its own: send the read, wait for the answer (polling in short
  slices, so an abort or a dead producer never hangs the engine), copy the
  frames into the request's blocks, report ``finished_recving``. A pull that
  fails reports why (``get_load_errors``); the scheduler then applies
  ``kv_load_failure_policy``.

The bytes go over TCP with pyzmq, which the engine already uses between its
processes (chapter 8): a frame is sent from the tensor's own memory (no copy
into a message), and the same code reaches another host by address. NIXL
(vLLM's default) would move the blocks by RDMA into the consumer's cache with
no CPU copy at all; on two CPU processes that gain is the copy out of the
frame, which ``scripts/bench_disagg.py`` measures against a plain copy.

vLLM 0.32 counterpart: ``nixl/pull_worker.py`` (``NixlConnectorWorker``:
``register_kv_caches``, ``start_load_kv``, ``get_finished``, the handshake
side channel and the expiry of ``_reqs_to_send``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import zmq

from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer.base import KVConnectorMetadata, KVConnectorWorker, KVTransferStats
from nanoengine.distributed.kv_transfer.zmq.metadata import (
    PullPlan,
    PullReply,
    PullRequest,
    ZmqConnectorMetadata,
)
from nanoengine.utils.deadlines import start_critical_thread

logger = logging.getLogger(__name__)

# How often the server and the pulls look up from their sockets: the longest an
# abort, an expiry or a shutdown waits.
_POLL_SLICE_MS = 20
# A read may beat the engine's registration of its hold by a step or two (the
# client heard of the blocks first): it waits this long before "not held here".
_EARLY_READ_GRACE_S = 5.0
_SERVER_START_TIMEOUT_S = 10.0
# A cancelled pull stops within a poll slice, or a second if it must tell the
# producer first (the release's linger); past this its blocks are not safe to reuse.
_CANCEL_TIMEOUT_S = 10.0
_PULL_THREADS = 8
# Frames are read-only buffers; torch says so once per process. The tensor made
# from a frame is only ever read (copied into the cache), so the warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class _Cancelled(Exception):
    """The request ended while its pull waited."""


@dataclass
class _Hold:
    block_ids: list[int]
    deadline: float  # time.monotonic()


@dataclass
class _ParkedRead:
    identity: bytes
    request: PullRequest
    arrived: float


@dataclass
class _Pull:
    future: Future[KVTransferStats]
    cancel: threading.Event = field(default_factory=threading.Event)


class ZmqConnectorWorker(KVConnectorWorker):
    """One rank's half of the ZmqConnector."""

    def __init__(self, config: KVTransferConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.kv_caches: list[torch.Tensor] = []
        self._context = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        # Shared with the server thread, under _lock: holds, ended holds, counters.
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._finished_sending: set[str] = set()
        self._stats = KVTransferStats()
        self._server: threading.Thread | None = None
        self._server_death: BaseException | None = None  # set if the server thread died
        # Consumer side: one future per request whose pull is under way.
        self._pullers = ThreadPoolExecutor(max_workers=_PULL_THREADS, thread_name_prefix="nanoengine-kv-pull")
        self._loading: dict[str, _Pull] = {}
        self._load_errors: dict[str, str] = {}

    @property
    def address(self) -> str:
        """Where this rank serves blocks (producer) or its peer rank does (for a pull plan)."""
        return f"tcp://{self.config.kv_ip}:{self.config.kv_port + self.rank}"

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Take the cache tensors; a producer starts serving them now (and fails now if the port is taken)."""
        self.kv_caches = kv_caches
        if self.config.is_producer and self._server is None:
            self._start_server()

    # ---- producer -------------------------------------------------------------------

    def _start_server(self) -> None:
        started = threading.Event()
        failure: list[str] = []
        self._server = start_critical_thread(lambda: self._serve(started, failure),
                                             f"nanoengine-kv-server-{self.rank}", self._server_died)
        if not started.wait(_SERVER_START_TIMEOUT_S):
            raise TimeoutError(f"the KV block server did not bind {self.address} within {_SERVER_START_TIMEOUT_S} s.")
        if failure:
            raise RuntimeError(f"the KV block server cannot listen on {self.address} (kv_ip, kv_port + rank "
                               f"{self.rank}): {failure[0]}")

    def _server_died(self, error: BaseException) -> None:
        self._server_death = error

    def _serve(self, started: threading.Event, failure: list[str]) -> None:
        """The server thread: answer reads and releases, end expired holds, until shutdown."""
        socket = self._context.socket(zmq.ROUTER)
        try:
            socket.bind(self.address)
        except zmq.ZMQError as error:
            failure.append(str(error))
            started.set()
            socket.close(linger=0)
            return
        started.set()
        parked: list[_ParkedRead] = []
        decoder = msgspec.msgpack.Decoder(PullRequest)
        try:
            while not self._stop.is_set():
                if socket.poll(_POLL_SLICE_MS if not parked else 1):
                    parked += self._receive_all(socket, decoder)
                parked = [read for read in parked if not self._answer(socket, read)]
                self._expire_holds()
        finally:
            socket.close(linger=0)

    def _receive_all(self, socket: zmq.Socket[bytes], decoder: msgspec.msgpack.Decoder[PullRequest]) -> list[_ParkedRead]:
        """Every message waiting on the socket, decoded (an undecodable one is answered at once)."""
        received: list[_ParkedRead] = []
        while True:
            try:
                identity, raw = socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return received
            try:
                request = decoder.decode(raw)
            except msgspec.DecodeError as error:
                self._reply_error(socket, identity, f"undecodable pull request: {error}")
                continue
            received.append(_ParkedRead(identity, request, time.monotonic()))

    def _answer(self, socket: zmq.Socket[bytes], read: _ParkedRead) -> bool:
        """Answer one read or release; False to keep it parked (its hold is not registered yet)."""
        request = read.request
        if request.engine_id != self.config.engine_id:
            if request.op == "read":
                self._reply_error(socket, read.identity, f"this producer is engine {self.config.engine_id}, not "
                                                         f"{request.engine_id} (was it restarted?)")
            return True
        with self._lock:
            hold = self._holds.get(request.request_id)
            if hold is None and time.monotonic() - read.arrived < _EARLY_READ_GRACE_S:
                return False
            if hold is None:
                if request.op == "read":
                    self._stats.num_failed_transfers += 1
                    self._reply_error(socket, read.identity, f"request {request.request_id!r} holds no blocks "
                                                             "here (expired, already read, or unknown)")
                return True
            del self._holds[request.request_id]
        if request.op == "read":
            self._send_blocks(socket, read.identity, request, hold)
        # Only now may the scheduler free the blocks: the read above copied them out.
        with self._lock:
            self._finished_sending.add(request.request_id)
        return True

    def _send_blocks(self, socket: zmq.Socket[bytes], identity: bytes, request: PullRequest, hold: _Hold) -> None:
        """Gather the asked blocks of every layer and send them, one frame per layer.

        The gather copies out of the cache (advanced indexing), so once it is
        done the scheduler may free and reuse the blocks while ZMQ still sends.
        """
        if not set(request.block_ids) <= set(hold.block_ids):
            self._reply_error(socket, identity, f"blocks {sorted(set(request.block_ids) - set(hold.block_ids))} "
                                                f"are not blocks of request {request.request_id!r}")
            return
        start = time.perf_counter()
        index = torch.tensor(request.block_ids, dtype=torch.long)
        layers = [cache.index_select(1, index) for cache in self.kv_caches]  # each [2, n, block, heads, dim]
        reply = PullReply(True, dtype=str(layers[0].dtype).removeprefix("torch."), shape=list(layers[0].shape))
        frames: list[Any] = [identity, self._encoder.encode(reply), *(layer.view(torch.uint8).numpy() for layer in layers)]
        socket.send_multipart(frames, copy=False)
        with self._lock:
            self._stats.num_transfers += 1
            self._stats.bytes_transferred += sum(layer.numel() * layer.element_size() for layer in layers)
            self._stats.transfer_seconds += time.perf_counter() - start

    def _reply_error(self, socket: zmq.Socket[bytes], identity: bytes, error: str) -> None:
        socket.send_multipart([identity, self._encoder.encode(PullReply(False, error=error))])

    def _expire_holds(self) -> None:
        """End the holds whose consumer never came (vLLM's abort-request timeout)."""
        now = time.monotonic()
        with self._lock:
            expired = [req_id for req_id, hold in self._holds.items() if hold.deadline <= now]
            for req_id in expired:
                del self._holds[req_id]
                self._finished_sending.add(req_id)
                self._stats.num_expired_holds += 1
        for req_id in expired:
            logger.warning("Releasing the KV blocks of request %s: no consumer read them within %.0f s.",
                           req_id, self.config.abort_request_timeout_s)

    # ---- both: one step ---------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Register new holds (producer) and start new pulls and releases (consumer)."""
        assert isinstance(metadata, ZmqConnectorMetadata)
        if metadata.reqs_to_send:
            deadline = time.monotonic() + self.config.abort_request_timeout_s
            with self._lock:
                for req_id, block_ids in metadata.reqs_to_send.items():
                    self._holds[req_id] = _Hold(block_ids, deadline)
        for plan in metadata.reqs_to_recv:
            if plan.local_block_ids:
                cancel = threading.Event()
                future = self._pullers.submit(self._pull, plan, cancel)
                self._loading[plan.request_id] = _Pull(future, cancel)
            else:
                self._pullers.submit(self._release, plan)

    def wait_for_finished_requests(self, finished_req_ids: set[str]) -> None:
        """Cancel the pulls of requests that ended, and wait the slice it takes them to stop.

        The blocks go back to the pool in this very step; a pull still copying
        into them would corrupt their next owner's KV.
        """
        for req_id in finished_req_ids & self._loading.keys():
            pull = self._loading.pop(req_id)
            pull.cancel.set()
            try:
                pull.future.exception(_CANCEL_TIMEOUT_S)  # waits for the thread to leave the copy
            except TimeoutError:
                raise RuntimeError(f"the pull of request {req_id!r} did not stop within {_CANCEL_TIMEOUT_S:g} s of "
                                   "its cancel; its blocks cannot safely go to another request") from None

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._server_death is not None:
            raise RuntimeError(f"the KV block server of rank {self.rank} died: {self._server_death!r}")
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
        recving: set[str] = set()
        for req_id in [req_id for req_id, pull in self._loading.items() if pull.future.done()]:
            error = self._loading.pop(req_id).future.exception()
            if error is None:
                recving.add(req_id)
            else:
                self._load_errors[req_id] = str(error)
        return sending, recving

    def get_load_errors(self) -> dict[str, str]:
        errors, self._load_errors = self._load_errors, {}
        return errors

    def get_kv_connector_stats(self) -> KVTransferStats | None:
        with self._lock:
            stats, self._stats = self._stats, KVTransferStats()
        return stats if stats else None

    # ---- consumer -----------------------------------------------------------------------

    def _connect(self, plan: PullPlan) -> zmq.Socket[bytes]:
        socket = self._context.socket(zmq.DEALER)
        socket.connect(f"tcp://{plan.remote_host}:{plan.remote_port + self.rank}")
        return socket

    def _request(self, plan: PullPlan, op: str) -> bytes:
        return self._encoder.encode(PullRequest(op, plan.remote_request_id, plan.remote_engine_id,
                                                plan.remote_block_ids))

    def _release(self, plan: PullPlan) -> None:
        """Tell the producer to free blocks this engine will not read (no answer comes)."""
        socket = self._connect(plan)
        socket.send(self._request(plan, "release"))
        socket.close(linger=1000)  # ZMQ sends it in the background; a dead peer costs at most this

    def _pull(self, plan: PullPlan, cancel: threading.Event) -> KVTransferStats:
        """Read the blocks into the request's own blocks; raises with the reason on any failure."""
        try:
            stats = self._read(plan, cancel)
        except _Cancelled:
            raise
        except Exception:
            with self._lock:
                self._stats.num_failed_transfers += 1
            raise
        with self._lock:
            self._stats.add(stats)
        return stats

    def _read(self, plan: PullPlan, cancel: threading.Event) -> KVTransferStats:
        start = time.perf_counter()
        where = f"{plan.remote_host}:{plan.remote_port + self.rank}"
        socket = self._connect(plan)
        try:
            socket.send(self._request(plan, "read"))
            deadline = time.monotonic() + self.config.transfer_timeout_s
            while not socket.poll(_POLL_SLICE_MS):
                if cancel.is_set():
                    self._release(plan)
                    raise _Cancelled(plan.request_id)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the producer at {where} did not answer within "
                                       f"{self.config.transfer_timeout_s:g} s (transfer_timeout_s); is it running?")
            frames = socket.recv_multipart(copy=False)
        finally:
            socket.close(linger=0)
        num_bytes = self._copy_into_cache(plan, frames, where)
        return KVTransferStats(1, num_bytes, time.perf_counter() - start)

    def _copy_into_cache(self, plan: PullPlan, frames: list[zmq.Frame], where: str) -> int:
        """Check the answer against this cache's shape, then copy each layer's frame into its blocks."""
        reply = msgspec.msgpack.decode(frames[0].bytes, type=PullReply)
        if not reply.ok:
            raise RuntimeError(f"the producer at {where} refused: {reply.error}")
        cache = self.kv_caches[0]
        expected = [2, len(plan.local_block_ids), *cache.shape[2:]]
        dtype = str(cache.dtype).removeprefix("torch.")
        if reply.shape != expected or reply.dtype != dtype or len(frames) - 1 != len(self.kv_caches):
            raise ValueError(f"the producer at {where} sent {len(frames) - 1} layers of {reply.dtype} {reply.shape}; "
                             f"this engine needs {len(self.kv_caches)} of {dtype} {expected} (same model, dtype, "
                             "block size and tensor-parallel size on both sides)")
        index = torch.tensor(plan.local_block_ids, dtype=torch.long)
        for cache, frame in zip(self.kv_caches, frames[1:]):
            layer = torch.frombuffer(frame.buffer, dtype=torch.uint8).view(cache.dtype).view(reply.shape)
            cache.index_copy_(1, index, layer)
        return sum(len(frame.buffer) for frame in frames[1:])

    def shutdown(self) -> None:
        """Stop the server and the pulls (each notices within one poll slice), then the sockets."""
        self._stop.set()
        for pull in self._loading.values():
            pull.cancel.set()
        self._pullers.shutdown(wait=True)
        if self._server is not None:
            self._server.join(timeout=5)
            if self._server.is_alive():
                # term() would wait for the server's socket to close: forever, if the thread is stuck.
                logger.warning("The KV block server of rank %d did not stop within 5 s; leaving its socket.", self.rank)
                return
        self._context.term()
