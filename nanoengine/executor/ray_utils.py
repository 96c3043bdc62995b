"""Ray plumbing for the Ray executor: the cluster, the reserved slots, the actor that hosts a rank.

Chapter 6 (tensor parallelism, "Many machines: the Ray executor").

* ``connect_to_ray`` joins the Ray cluster of this machine, or starts one;
* ``reserve_rank_slots`` books one *bundle* (a CPU or a GPU) per rank in a
  placement group, so every rank has its device before any starts (ranks
  loading a model while the last one waits for a GPU would stall the first
  collective);
* ``RayWorkerWrapper`` is the body of each actor, hosting one rank's worker
  (``start_actor`` starts one in a bundle);
* ``wait_for_ranks`` turns the first failed rank -- an exception, or a dead
  actor -- into an error naming it, instead of a wait on a collective.

Ray is an optional extra (``pip install 'nanoengine[ray]'``); without it,
importing this module raises a ModuleNotFoundError that says so.

vLLM 0.32 counterpart: ``vllm/v1/executor/ray_utils.py`` (``RayWorkerWrapper``,
``initialize_ray_cluster``, ``_wait_until_pg_ready``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.placement_group import PlacementGroup, placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ModuleNotFoundError as exc:  # the optional extra is missing
    # Still a ModuleNotFoundError naming Ray: Executor.get_class turns it into a ValueError.
    raise ModuleNotFoundError(
        "distributed_executor_backend='ray' needs Ray, an optional extra: pip install 'nanoengine[ray]'",
        name=exc.name,
    ) from exc

from nanoengine.config import EngineConfig
from nanoengine.utils.system_utils import get_distributed_init_method, get_open_port
from nanoengine.worker.worker_base import WorkerWrapperBase

# How long the placement group may wait for CPUs/GPUs that other jobs hold.
PLACEMENT_TIMEOUT_S = 60.0
# Passed from the driver to every rank: an actor inherits the environment of
# its machine's `ray start`, which on another machine is not the driver's shell.
FORWARDED_ENV_PREFIXES = ("NANOENGINE_", "HF_", "TRANSFORMERS_", "GLOO_", "NCCL_")


class RankFailedError(RuntimeError):
    """One rank's worker raised, or its actor process died; the message names the rank."""


@dataclass(frozen=True)
class ActorPlacement:
    """Where Ray started one actor: what the executor needs to number the ranks."""

    node_id: str  # Ray's id of the machine
    node_ip: str
    pid: int
    gpu_ids: tuple[str, ...]  # the GPUs Ray reserved for this actor; () on CPU


def connect_to_ray() -> bool:
    """Join a Ray cluster or start a local one; True when this call ran ``ray.init``.

    vLLM's rule, ``ray.init()`` with no address: Ray joins the cluster named by
    ``RAY_ADDRESS``, else the one ``ray start`` runs on this machine, else starts
    a one-machine cluster owned by this process. A session the caller opened
    (a test, a notebook) is left as it is, at start and at shutdown.
    """
    if ray.is_initialized():
        return False
    # Ray otherwise asks (on a terminal) whether it may send usage statistics.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # No dashboard (a web server process) for a cluster that lives only as long
    # as this engine; ignored when joining a cluster, whose `ray start` decided.
    ray.init(include_dashboard=False)
    return True


def reserve_rank_slots(world_size: int, device_type: str) -> PlacementGroup:
    """A placement group with one bundle per rank: one GPU each on CUDA, else one CPU.

    "PACK" fills one machine before the next: ranks that share a machine talk fastest.
    """
    resource = "GPU" if device_type == "cuda" else "CPU"
    in_cluster = ray.cluster_resources().get(resource, 0)
    if in_cluster < world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} needs {world_size} {resource}s in the Ray cluster, "
            f"which has {in_cluster:g} (see `ray status`)."
        )
    group = placement_group([{resource: 1.0}] * world_size, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ValueError(
            f"The Ray cluster could not reserve {world_size} x {{{resource}: 1}} within "
            f"{PLACEMENT_TIMEOUT_S:g} s: other jobs hold them (see `ray status`)."
        )
    return group


def forwarded_env() -> dict[str, str]:
    """The driver's settings every rank should see (tokens, caches, network interfaces)."""
    return {name: value for name, value in os.environ.items() if name.startswith(FORWARDED_ENV_PREFIXES)}


def rank_order(placements: Sequence[ActorPlacement], driver_node_id: str) -> list[int]:
    """Actor indices in rank order: the driver's machine first, then machine by machine.

    Rank 0's output is the one the engine reads, best read next door; and with
    each machine's ranks contiguous, ``local_rank`` is a count along the machine.
    """
    return sorted(
        range(len(placements)),
        key=lambda i: (placements[i].node_id != driver_node_id, placements[i].node_ip, placements[i].node_id),
    )


class RayWorkerWrapper(WorkerWrapperBase):
    """The body of one Ray actor: a process, on any machine, hosting one rank's worker.

    The actor exists before its rank does (ranks are numbered once every actor
    has said where it landed), so ``start_worker`` brings rank and worker later;
    vLLM renumbers its actors the same way (``adjust_rank``).
    """

    def placement(self) -> ActorPlacement:
        context = ray.get_runtime_context()
        gpu_ids = tuple(str(i) for i in context.get_accelerator_ids().get("GPU", []))
        return ActorPlacement(context.get_node_id(), ray.util.get_node_ip_address(), os.getpid(), gpu_ids)

    def rendezvous_address(self, host: str) -> str:
        """``tcp://host:port``, the port free on *this* machine: rank 0's, where the store listens."""
        return get_distributed_init_method(host, get_open_port())

    def use_gpus(self, gpu_ids: Sequence[str]) -> None:
        """Show this process every GPU the engine holds on its machine (before CUDA starts).

        Then ``local_rank`` indexes the device and NCCL sees the peers' GPUs (vLLM does the same).
        """
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)

    def start_worker(
        self, rank: int, engine_config: EngineConfig, local_rank: int, distributed_init_method: str,
        local_world_size: int,
    ) -> None:
        self.rpc_rank = rank
        self.init_worker(engine_config, local_rank, distributed_init_method, local_world_size)

    def run_call(
        self,
        method: str | Callable[..., Any],
        unique_reply_rank: int | None,
        kwargs: dict[str, Any],
        *args: Any,
    ) -> Any:
        """Run one ``collective_rpc`` call; its result goes back only from the rank asked.

        ``args`` come last and loose: Ray swaps an ObjectRef for its value only
        when it is a whole argument, not inside a tuple.
        """
        result = self.execute_method(method, *args, **kwargs)
        return result if unique_reply_rank in (None, self.rpc_rank) else None


# The actor class, made once; each rank's actor gets its own bundle through .options().
_RAY_WORKER_ACTOR = ray.remote(RayWorkerWrapper)


def start_actor(group: PlacementGroup, bundle: int, device_type: str) -> Any:
    """A ``RayWorkerWrapper`` actor held to ``bundle`` of ``group`` (one CPU, or one GPU)."""
    on_gpu = device_type == "cuda"
    env = forwarded_env()
    if on_gpu:
        # Ray would hide every GPU but the actor's own; the executor shows
        # each rank its machine's GPUs itself (use_gpus), as vLLM does.
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    return _RAY_WORKER_ACTOR.options(
        num_cpus=0 if on_gpu else 1,
        num_gpus=1 if on_gpu else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle),
        runtime_env={"env_vars": env},
    ).remote()


# How long a rank's raised error waits for news of a dead peer. A rank killed
# mid-step makes its peers fail too (gloo: "Connection reset by peer"), and that
# error can reach us before Ray has noticed the death (about a second); the death
# is the cause, so it is the one to report.
PEER_DEATH_GRACE_S = 3.0


def wait_for_ranks(refs: Sequence[ray.ObjectRef], what: str, timeout_s: float | None) -> list[Any]:
    """Every rank's result in rank order; the first rank to fail raises ``RankFailedError``.

    ``ray.wait`` hands back a reference once its call finished *or failed*, so
    a rank that raised or died (Ray notices a dead actor within a second) is
    reported while its peers still wait for it in a collective. ``timeout_s``
    bounds the rest: a rank that hangs while alive.
    """
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            late = sorted(rank_of[ref] for ref in pending)
            raise RankFailedError(f"Worker rank(s) {late} did not answer {what!r} within {timeout_s:g} s.")
        rank = rank_of[ready[0]]
        try:
            results[rank] = _result_of(ready[0], rank, what)
        except RankFailedError as raised:
            raise _dead_peer_error(pending, rank_of, what) or raised
    return results


def _dead_peer_error(pending: list[ray.ObjectRef], rank_of: dict[ray.ObjectRef, int], what: str) -> RankFailedError | None:
    """The error of a peer that died, if one is found within ``PEER_DEATH_GRACE_S``, else None."""
    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            _result_of(ready[0], rank_of[ready[0]], what)
        except RankFailedError as error:
            if isinstance(error.__cause__, RayActorError):
                return error
    return None


def _result_of(ref: ray.ObjectRef, rank: int, what: str) -> Any:
    try:
        return ray.get(ref)
    except RayActorError as exc:
        raise RankFailedError(f"Worker rank {rank} (a Ray actor) died during {what!r}: {type(exc).__name__}.") from exc
    except RayTaskError as exc:
        cause = exc.cause if exc.cause is not None else exc
        raise RankFailedError(f"Worker rank {rank} raised in {what!r}: {type(cause).__name__}: {cause}") from exc
