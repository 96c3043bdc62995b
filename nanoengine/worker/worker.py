"""Worker: the four construction steps of chapter 6, then one call per engine step.

``LLM(...)`` reaches the worker through the executor and runs, in this order:
``init_device`` -> ``load_model`` -> ``determine_available_memory`` ->
``initialize_from_config``. The third one is the pivot of chapter 6: a profiling
forward pass shows what the model needs, and what is left of the budget becomes
the KV cache -- which fixes how many requests can run at once (chapter 2).
Under tensor parallelism (chapter 6) each rank has a Worker of its own, in its
own process; ``init_device`` joins the ranks into one group first.
vLLM 0.32 counterpart: ``vllm/v1/worker/gpu_worker.py`` (``Worker``,
``init_worker_distributed_environment``) and, for the CPU budget,
``vllm/v1/worker/cpu_worker.py`` (``CPUWorker.determine_available_memory``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nanoengine.config import EngineConfig
from nanoengine.core.sched.output import GrammarOutput, SchedulerOutput
from nanoengine.distributed.parallel_state import (
    default_backend,
    destroy_distributed_environment,
    destroy_model_parallel,
    init_distributed_environment,
    initialize_model_parallel,
)
from nanoengine.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from nanoengine.outputs import DraftTokenIds, ModelRunnerOutput
from nanoengine.utils.system_utils import usable_cpu_count
from nanoengine.worker.memory_probe import PeakMemoryProbe
from nanoengine.worker.model_runner import ModelRunner


@dataclass
class MemoryProfile:
    """What ``determine_available_memory`` measured and decided, in bytes."""

    device: str
    weights_bytes: int
    # The profiling pass's peak above the weights: torch's allocator peak on
    # CUDA; on CPU the growth of the process's peak RSS (see memory_probe.py),
    # which also counts the pass's small temporary KV blocks.
    peak_activation_bytes: int
    budget_source: str  # which knob set the KV budget, in words
    kv_cache_bytes: int
    profile_seconds: float
    # CUDA: memory outside torch's allocator (CUDA context, other processes).
    non_torch_bytes: int = 0
    # CUDA: what capturing the decode graphs took (filled in after capture).
    cudagraph_bytes: int = 0
    # The engine's whole allowance: utilisation share of the GPU, or on CPU the
    # KV budget plus what the model already holds.
    total_budget_bytes: int = 0
    activation_method: str = ""  # how peak_activation_bytes was measured, in words

    def describe(self) -> str:
        """Where the budget went, for the "KV cache too small" error."""
        mib = 1 << 20
        used = f"weights {self.weights_bytes / mib:.0f} MiB, peak activations {self.peak_activation_bytes / mib:.0f} MiB"
        if self.device == "cuda":
            used += f", non-torch {self.non_torch_bytes / mib:.0f} MiB"
        return (
            f"Memory profile: {used}; the KV cache got {self.kv_cache_bytes / mib:.0f} MiB "
            f"of an engine budget of {self.total_budget_bytes / mib:.0f} MiB, set by {self.budget_source}."
        )


class Worker:
    """One device, one model runner; under tensor parallelism, one rank."""

    def __init__(
        self,
        engine_config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
        local_world_size: int | None = None,
    ) -> None:
        self.engine_config = engine_config
        # rank: this worker's place in the tensor-parallel group; local_rank:
        # which of this machine's GPUs it drives (the same on one machine).
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.world_size = engine_config.parallel_config.world_size
        # The ranks on this worker's machine, which share its cores and RAM: all
        # of them on one machine; under Ray, those its placement put here.
        self.local_world_size = local_world_size or self.world_size
        device = engine_config.device_config.device
        # One rank keeps "cuda" (the current device), as before; ranks of a
        # group each drive their own GPU.
        self.device = torch.device(f"cuda:{local_rank}" if device == "cuda" and self.world_size > 1 else device)
        self.model_runner: ModelRunner | None = None
        self.memory_profile: MemoryProfile | None = None

    def init_device(self) -> None:
        """Pick the device, join the tensor-parallel group, seed every random stream.

        The group comes before ``load_model``: the parallel layers read their
        rank and the group's size when they are built, to allocate only their
        slice of each weight (chapter 6).
        """
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
        if self.world_size > 1:
            self._init_distributed()
        # The same seed on every rank: each samples the same tokens from the
        # same (gathered) logits, so only rank 0's output needs to travel.
        torch.manual_seed(self.engine_config.model_config.seed)
        self.model_runner = ModelRunner(self.engine_config, self.device, self.rank)

    def _init_distributed(self) -> None:
        """Join the group (gloo on a CPU, NCCL on CUDA) and share the CPU among the ranks."""
        if self.distributed_init_method is None:
            raise ValueError(f"Rank {self.rank} of {self.world_size} needs a distributed_init_method.")
        if self.device.type == "cpu":
            # N ranks on one CPU: each gets its share of the cores, or their
            # OpenMP pools would fight over the same cores (chapter 7).
            torch.set_num_threads(max(1, usable_cpu_count() // self.local_world_size))
        init_distributed_environment(
            world_size=self.world_size,
            rank=self.rank,
            distributed_init_method=self.distributed_init_method,
            local_rank=self.local_rank,
            backend=default_backend(self.device),
        )
        initialize_model_parallel(self.engine_config.parallel_config.tensor_parallel_size)

    def shutdown(self) -> None:
        """Stop the runner's KV connector; leave the tensor-parallel group (a one-rank worker never joined one)."""
        if self.model_runner is not None:
            self.model_runner.shutdown()
        if self.world_size > 1:
            destroy_model_parallel()
            destroy_distributed_environment()

    def load_model(self) -> None:
        self._runner().load_model()

    def get_kv_cache_spec(self) -> FullAttentionSpec | dict[int, KVCacheSpec]:
        return self._runner().get_kv_cache_spec()

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Run the profiling pass and return the bytes the KV cache may use."""
        runner = self._runner()
        cache_config = self.engine_config.cache_config
        weights = runner.weights_bytes()
        with PeakMemoryProbe(self.device) as probe:
            profile_seconds = runner.profile_run()
        peak_activation = probe.peak_growth_bytes
        non_torch = 0
        if cache_config.kv_cache_memory_bytes is not None:
            kv_bytes, source = cache_config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif self.device.type == "cuda":
            non_torch = self._non_torch_bytes()
            kv_bytes, source = (
                self._cuda_budget(weights + peak_activation, non_torch),
                "gpu_memory_utilization",
            )
        else:
            kv_bytes, source = self._cpu_budget(), "cpu_kv_cache_fraction of available RAM"
        if self.device.type == "cuda":
            total_budget = int(torch.cuda.mem_get_info(self.device)[1] * cache_config.gpu_memory_utilization)
        else:
            total_budget = weights + peak_activation + kv_bytes
        self.memory_profile = MemoryProfile(
            device=self.device.type,
            weights_bytes=weights,
            peak_activation_bytes=peak_activation,
            budget_source=source,
            kv_cache_bytes=kv_bytes,
            profile_seconds=profile_seconds,
            non_torch_bytes=non_torch,
            total_budget_bytes=total_budget,
            activation_method=probe.method,
        )
        return kv_bytes

    def _cpu_budget(self) -> int:
        """A fraction of the RAM still available after loading, capped; a rank's share of it.

        The weights and the profiling pass already live in this process, so
        "available" is what is left for everything else on the machine too; the
        fraction leaves most of it alone. Tensor-parallel ranks on one machine
        share its RAM: each takes 1/local_world_size of the budget (and stores
        only its heads' K/V, so the engine still gets the block count of one process).
        """
        cache_config = self.engine_config.cache_config
        budget = int(available_ram_bytes() * cache_config.cpu_kv_cache_fraction)
        return min(budget, cache_config.cpu_kv_cache_max_bytes) // self.local_world_size

    def _non_torch_bytes(self) -> int:
        """Device memory in use outside this process's torch allocator (the CUDA
        context, other processes); it counts against the share all the same.
        """
        free, total = torch.cuda.mem_get_info(self.device)
        return max((total - free) - torch.cuda.memory_reserved(self.device), 0)

    def _cuda_budget(self, torch_peak_bytes: int, non_torch_bytes: int) -> int:
        """The utilisation share of the whole GPU, minus what the model and any
        other process already take.
        """
        total = torch.cuda.mem_get_info(self.device)[1]
        allowed = int(total * self.engine_config.cache_config.gpu_memory_utilization)
        return max(allowed - torch_peak_bytes - non_torch_bytes, 0)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the KV cache the engine decided on and bind it to the layers."""
        self._runner().initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        """Capture the decode CUDA graphs (GPU, unless enforce_eager); record their memory."""
        graph_bytes = self._runner().capture_model()
        if self.memory_profile is not None:
            self.memory_profile.cudagraph_bytes = graph_bytes

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self._runner().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self._runner().sample_tokens(grammar_output)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self._runner().take_draft_token_ids()

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("init_device() must run before the worker is used.")
        return self.model_runner


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
