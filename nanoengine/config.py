"""Engine configuration: the knobs ``LLM(...)`` accepts, grouped as vLLM groups them.

Chapter 6 (``LLM(...)`` construction) explains how these numbers become a KV cache
of a certain size; chapter 2 (batch size) and chapter 3 (scheduler) show what the
scheduler knobs do. vLLM 0.32 counterpart: ``vllm/config/`` (``ModelConfig``,
``CacheConfig``, ``SchedulerConfig``, ``DeviceConfig``, ``ParallelConfig``, ``VllmConfig``).

Plain dataclasses without torch: the scheduler and KV cache manager read them and
must stay device-free. ``EngineArgs`` (engine/arg_utils.py) fills them in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ModelConfig:
    """What model runs, resolved to a local directory, and its shape."""

    model: str  # as the user wrote it: a short name, a local dir or a hub id
    model_path: str  # the local HF directory it resolved to
    hf_config: Any  # transformers.PretrainedConfig; Any keeps transformers out of core/
    max_model_len: int
    dtype: str = "float32"
    seed: int = 0
    # Chapter 7: "auto" picks Triton on CUDA and the C++ kernels ("cpu") on a CPU;
    # "cpu" also switches RMSNorm, RoPE and SiLU-and-mul to their C++ kernels.
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    # Chapter 7: "auto" prepacks the linear weights on a CPU (nanoengine's GEMM with
    # AVX-512 in fp32, else oneDNN), else F.linear.
    linear_backend: Literal["auto", "torch", "onednn", "cpu"] = "auto"
    # Chapter 7: True keeps every step eager (no CUDA graphs).
    enforce_eager: bool = False
    # Decode batch sizes captured as CUDA graphs; None = the default ladder.
    cudagraph_capture_sizes: list[int] | None = None
    # Chapter 6: "auto" reads the checkpoint's safetensors; "dummy" builds the
    # same model and fills it with seeded random values (model_loader/loader.py).
    load_format: Literal["auto", "dummy"] = "auto"
    # Chapter 6: True loads no tokenizer; prompts must then be token ids and
    # outputs carry token ids with empty text (vLLM's skip_tokenizer_init).
    skip_tokenizer_init: bool = False

    @property
    def hf_text_config(self) -> Any:
        """The config of the language model: the whole config, or a multimodal
        checkpoint's ``text_config`` (Qwen3.5's released models carry a vision tower)."""
        return self.hf_config.get_text_config()

    @property
    def vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_text_config.num_hidden_layers)

    @property
    def layer_types(self) -> list[str]:
        """Each layer's kind: "full_attention" everywhere, but in a hybrid model
        (Qwen3.5), whose config lists "linear_attention" for its state layers."""
        types = getattr(self.hf_text_config, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.num_layers

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one kind: the KV cache then has several groups (chapter 4)."""
        return len(set(self.layer_types)) > 1

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_text_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_text_config
        head_dim = getattr(cfg, "head_dim", None)
        return int(head_dim or cfg.hidden_size // cfg.num_attention_heads)


@dataclass
class CacheConfig:
    """How the KV cache is sized and shared."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # CUDA: the fraction of the GPU's memory the whole engine may use.
    gpu_memory_utilization: float = 0.9
    # An explicit byte budget for the KV cache (CPU or CUDA); overrides the fractions.
    kv_cache_memory_bytes: int | None = None
    # CPU: the fraction of *available* RAM given to the KV cache when no byte budget
    # is set, capped at ``cpu_kv_cache_max_bytes`` (vLLM's VLLM_CPU_KVCACHE_SPACE plays
    # this role, as a fixed number of GiB).
    cpu_kv_cache_fraction: float = 0.1
    cpu_kv_cache_max_bytes: int = 4 << 30
    # Skip profiling and use exactly this many blocks (tests, experiments).
    num_gpu_blocks_override: int | None = None
    # Filled in after determine_available_memory (chapter 6).
    num_gpu_blocks: int | None = None


@dataclass
class SchedulerConfig:
    """The per-step budget of chapter 3."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Chapter 7: schedule step N+1 while step N runs (AsyncScheduler and
    # EngineCore.step_with_batch_queue); the synchronous loop is the default.
    async_scheduling: bool = False


@dataclass
class ObservabilityConfig:
    """Debug switches of chapters 3 and 4 (also ``NANOENGINE_TRACE`` / ``NANOENGINE_CHECK_INVARIANTS``)."""

    trace: bool = False  # record a StepTrace per step (nanoengine/instruments/trace/)
    check_invariants: bool = False  # run instruments/invariants.py after every step


@dataclass
class KVTransferConfig:
    """A KV connector between engines (chapter 5: WAITING_FOR_REMOTE_KVS).

    vLLM 0.32 counterpart: ``vllm/config/kv_transfer.py`` (``KVTransferConfig``);
    vLLM passes the directory in ``kv_connector_extra_config``.
    """

    shared_storage_path: str
    # "kv_producer" saves prefilled blocks, "kv_consumer" loads them, "kv_both" does both.
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    kv_connector: Literal["SharedStorageConnector"] = "SharedStorageConnector"

    def __post_init__(self) -> None:
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', got {self.kv_role!r}."
            )
        if self.kv_connector != "SharedStorageConnector":
            raise ValueError(f"kv_connector must be 'SharedStorageConnector', got {self.kv_connector!r}.")
        if not isinstance(self.shared_storage_path, str) or not self.shared_storage_path:
            raise ValueError(
                f"shared_storage_path must be a non-empty path, got {self.shared_storage_path!r}."
            )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class ParallelConfig:
    """How many devices share one model (chapter 6, tensor parallelism).

    vLLM 0.32 counterpart: ``vllm/config/parallel.py`` (``ParallelConfig``); only
    tensor parallelism is built here, on one machine, so the world size is the
    tensor-parallel size and every rank is also its local rank.
    """

    tensor_parallel_size: int = 1
    # Who starts the workers: "uni" one in-process worker, "mp" one process per
    # rank, "ray" Ray actors. None until EngineArgs resolves it as vLLM does:
    # "uni" for one rank, "mp" for more.
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass
class SpeculativeConfig:
    """Speculative decoding (chapter 9): who drafts, and how many tokens per step.

    ``method="ngram"`` drafts from the request's own tokens (prompt lookup):
    the longest suffix of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens
    that also occurs earlier, and what followed it there. ``"draft_model"``
    drafts with a smaller ``model``. Unset lookup bounds follow vLLM: both
    unset means 5 and 5, one set stands for both.

    vLLM 0.32 counterpart: ``vllm/config/speculative.py`` (``SpeculativeConfig``).
    """

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # the draft model, for method="draft_model"

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"method must be 'ngram' or 'draft_model', got {self.method!r}.")
        count = self.num_speculative_tokens
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_speculative_tokens must be an int of at least 1, got {count!r}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("method='draft_model' needs model: the draft model's name or folder.")
        if self.method == "ngram":
            self.prompt_lookup_min, self.prompt_lookup_max = _lookup_bounds(self.prompt_lookup_min,
                                                                            self.prompt_lookup_max)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs beyond the tokens it verifies: a draft model
        writes the KV of its own guesses there; an n-gram search writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def _lookup_bounds(low: int | None, high: int | None) -> tuple[int, int]:
    """vLLM's rule for the n-gram bounds: one given stands for both; none given is 5 and 5."""
    low, high = (low if low is not None else high), (high if high is not None else low)
    low, high = (5 if low is None else low), (5 if high is None else high)
    if not 1 <= low <= high:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {low} and {high}.")
    return low, high


@dataclass
class DeviceConfig:
    device: str = "cpu"  # "cpu" or "cuda"


@dataclass
class EngineConfig:
    """All of the above in one object (vLLM calls it ``VllmConfig``)."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    # Chapter 9: None = no speculative decoding.
    speculative_config: SpeculativeConfig | None = None
