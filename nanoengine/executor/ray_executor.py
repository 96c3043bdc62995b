"""RayDistributedExecutor: the tensor-parallel ranks as Ray actors, on one machine or many.

Chapter 6 ("Many machines: the Ray executor"). The engine core sees the same
``Executor`` as with ``MultiprocExecutor`` (executor/abstract.py): every call is
a ``collective_rpc`` to all ranks, the KV block count is the smallest rank's,
each step answers with rank 0's ModelRunnerOutput. What changes is who starts
the worker processes, and where: Ray, on any machine of its cluster.

Start-up, in order:

1. ``connect_to_ray`` -- join the cluster (``ray start`` on each machine) or
   start a one-machine cluster;
2. ``reserve_rank_slots`` -- a placement group with one bundle (one GPU, or on
   a CPU one CPU) per rank, so every rank has its device before any starts;
3. one ``RayWorkerWrapper`` actor per bundle; each says which machine it landed
   on, and the ranks are numbered driver's machine first, each machine's
   ranks contiguous (``local_rank`` = the position on the machine);
4. rank 0's actor picks a port free on its machine; every actor builds its
   worker with ``(rank, local_rank, tcp://rank0-host:port)``, and the ranks meet
   there in ``init_device`` (torch.distributed: gloo on CPU, NCCL on CUDA).

A call puts each argument into Ray's object store once (``ray.put``) for all
ranks to read. Ray runs one actor's calls in the order this engine thread sent
them, so on every rank a step's ``sample_tokens`` follows its ``execute_model``.

vLLM 0.32 counterpart: ``vllm/v1/executor/ray_executor.py``
(``RayDistributedExecutor``, ``_init_workers_ray``). vLLM drives the steps
through a Ray compiled graph (channels between the actors, set up once);
nanoengine sends plain actor calls, slower per step but the same shape as the
multiprocess executor's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from nanoengine.executor.abstract import Executor

# Ray itself comes through ray_utils, whose import says how to install it when it is missing.
from nanoengine.executor.ray_utils import (
    ActorPlacement,
    RankFailedError,
    connect_to_ray,
    rank_order,
    ray,
    reserve_rank_slots,
    start_actor,
    wait_for_ranks,
)
from nanoengine.worker.worker_base import method_name

# Joining the group and loading a slice of the weights happen before a rank is
# ready; a rank still busy after this long is taken as stuck. (Dead or raising
# ranks are reported at once: wait_for_ranks does not wait for the others.)
STARTUP_TIMEOUT_S = 600.0


class RayWorkerHandle:
    """The engine's view of one rank: its actor, and where Ray started it."""

    def __init__(self, rank: int, local_rank: int, actor: Any, placement: ActorPlacement) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.actor = actor  # a ray.actor.ActorHandle of a RayWorkerWrapper
        self.placement = placement



class RayDistributedExecutor(Executor):
    """One Ray actor per tensor-parallel rank; calls go to all, rank 0's output comes back."""

    def _init_executor(self) -> None:
        self.workers: list[RayWorkerHandle] = []
        self._actors: list[Any] = []  # every actor created, numbered or not: shutdown kills them all
        self.placement_group: Any = None
        self._started_ray = False
        self._is_shut_down = False
        # Waits for non-blocking calls while the engine thread goes on (it
        # builds the grammar bitmask meanwhile); one thread keeps them in order.
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoengine-ray-wait")
        try:
            self._start_workers()
            self.collective_rpc("init_device", timeout=STARTUP_TIMEOUT_S)
            self.collective_rpc("load_model", timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            # A failed start leaves no actor, reserved CPU/GPU or Ray cluster behind.
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        device_type = self.engine_config.device_config.device
        world_size = self.parallel_config.world_size
        self._started_ray = connect_to_ray()
        self.placement_group = reserve_rank_slots(world_size, device_type)
        self._actors = [start_actor(self.placement_group, bundle, device_type) for bundle in range(world_size)]
        placements = wait_for_ranks([actor.placement.remote() for actor in self._actors], "placement", None)
        self.workers = self._number_ranks(placements)
        if device_type == "cuda":
            self._show_each_rank_its_machines_gpus()
        # Ranks per machine: they split that machine's cores and RAM between them.
        ranks_per_node = Counter(w.placement.node_id for w in self.workers)
        init_method = self._rendezvous(one_machine=len(ranks_per_node) == 1)
        starts = [
            w.actor.start_worker.remote(w.rank, self.engine_config, w.local_rank, init_method, ranks_per_node[w.placement.node_id])
            for w in self.workers
        ]
        wait_for_ranks(starts, "start_worker", STARTUP_TIMEOUT_S)

    def _number_ranks(self, placements: list[ActorPlacement]) -> list[RayWorkerHandle]:
        """One handle per actor, in rank order; ``local_rank`` counts the ranks before it on its machine."""
        handles: list[RayWorkerHandle] = []
        ranks_on_node: dict[str, int] = {}
        for rank, index in enumerate(rank_order(placements, ray.get_runtime_context().get_node_id())):
            node = placements[index].node_id
            local_rank = ranks_on_node.get(node, 0)
            ranks_on_node[node] = local_rank + 1
            handles.append(RayWorkerHandle(rank, local_rank, self._actors[index], placements[index]))
        return handles

    def _show_each_rank_its_machines_gpus(self) -> None:
        """Every rank sees the GPUs reserved on its machine, sorted; its ``local_rank`` indexes them."""
        gpus_on: dict[str, list[str]] = {}
        for w in self.workers:
            gpus_on.setdefault(w.placement.node_id, []).extend(w.placement.gpu_ids)
        calls = [w.actor.use_gpus.remote(sorted(gpus_on[w.placement.node_id], key=int)) for w in self.workers]
        wait_for_ranks(calls, "use_gpus", None)

    def _rendezvous(self, one_machine: bool) -> str:
        """Where the ranks meet: rank 0's machine, on a port free there.

        On one machine the loopback address always works, whereas the machine's
        other addresses may sit on interfaces the ranks cannot reach (vLLM's rule).
        """
        rank0 = self.workers[0]
        host = "127.0.0.1" if one_machine else rank0.placement.node_ip
        address: str = ray.get(rank0.actor.rendezvous_address.remote(host))
        return address

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Start the call on every rank; every rank's result, or ``unique_reply_rank``'s.

        A function as ``method`` reaches the actors through cloudpickle (Ray's
        serializer); it must be importable there, like any code the ranks run.
        """
        self._raise_if_failed()
        name = method_name(method)
        # One copy of each argument in the object store, read by every rank,
        # instead of one pickled copy per rank.
        shared_args = tuple(ray.put(arg) for arg in args)
        refs = [
            w.actor.run_call.remote(method, unique_reply_rank, kwargs or {}, *shared_args) for w in self.workers
        ]
        if non_block:
            return self._waiter.submit(self._collect, refs, name, timeout, unique_reply_rank)
        return self._collect(refs, name, timeout, unique_reply_rank)

    def _collect(
        self, refs: list[ray.ObjectRef], name: str, timeout: float | None, unique_reply_rank: int | None
    ) -> Any:
        """Wait for every rank; after a rank failed, stop them all (they may disagree now)."""
        try:
            results = wait_for_ranks(refs, name, timeout)
        except RankFailedError as error:
            # One rank may now wait in a collective for a peer that gave up:
            # kill them all and refuse later calls, as MultiprocExecutor does.
            self._failure = error
            self._kill_actors()
            raise
        return results if unique_reply_rank is None else results[unique_reply_rank]

    def _kill_actors(self) -> None:
        # Forceful on purpose: a rank may sit in a collective whose peer died.
        for actor in self._actors:
            ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        """Kill every actor, free the placement group, and stop Ray if this executor started it."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._failure = self._failure or RuntimeError("the executor was shut down")
        if ray.is_initialized():
            self._kill_actors()
            if self.placement_group is not None:
                ray.util.remove_placement_group(self.placement_group)
        # A call still waited for fails now that its actors are dead; let it
        # finish before Ray goes away under it.
        self._waiter.shutdown(wait=True, cancel_futures=True)
        if self._started_ray:
            ray.shutdown()
