"""Engine configuration: the knobs ``LLM(...)`` accepts, grouped as vLLM groups them.

Chapter 6 (``LLM(...)`` construction) explains how these numbers become a KV cache
of a certain size; chapter 2 (batch size) and chapter 3 (scheduler) show what the
scheduler knobs do. vLLM 0.32 counterpart: ``vllm/config/`` (``ModelConfig``,
``CacheConfig``, ``SchedulerConfig``, ``DeviceConfig``, ``ParallelConfig``, ``VllmConfig``).

Plain dataclasses without torch: the scheduler and KV cache manager read them and
must stay device-free. ``EngineArgs`` (engine/arg_utils.py) fills them in.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from nanoengine.transformers_utils.config import layer_types_of, sliding_window_of


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
    # Chapters 2 and 6: "gguf" keeps llama.cpp's quantized blocks in memory, read
    # from ``gguf_file`` (layers/quantization/); None: the folder's float weights.
    quantization: Literal["gguf"] | None = None
    gguf_file: str | None = None

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
        """Each layer's kind: "full_attention", "sliding_attention" (Mistral,
        Gemma 3's local layers) or "linear_attention" (Qwen3.5's state layers)."""
        return layer_types_of(self.hf_text_config)

    @property
    def sliding_window(self) -> int | None:
        """Keys a sliding-window layer reads back, itself included (None: the model has none)."""
        return sliding_window_of(self.hf_text_config) if "sliding_attention" in self.layer_types else None

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one kind: the KV cache then has several groups (chapter 4)."""
        return len(set(self.layer_types)) > 1

    @property
    def has_state_layers(self) -> bool:
        """Layers that keep a recurrent state rather than K and V (Qwen3.5's Gated DeltaNet)."""
        return "linear_attention" in self.layer_types

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


# The connectors nanoengine has, and the keys each reads from kv_connector_extra_config.
# "SharedStorageConnector" is chapter 5's one-machine example (vLLM 0.32 calls
# its twin ExampleConnector); "ZmqConnector" is chapter 10's network connector.
KV_CONNECTOR_EXTRA_KEYS: dict[str, tuple[str, ...]] = {
    "SharedStorageConnector": ("shared_storage_path",),
    "ZmqConnector": ("abort_request_timeout_s", "transfer_timeout_s"),
}
# vLLM's NIXL default for VLLM_NIXL_ABORT_REQUEST_TIMEOUT: how long a producer
# holds a finished prefill's blocks for a consumer that has not read them.
DEFAULT_ABORT_REQUEST_TIMEOUT_S = 480.0
# How long a consumer waits for the producer's answer to one pull.
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


def check_config_dict(name: str, config_class: type, value: Any) -> None:
    """A config given in vLLM's dict (JSON) form: a dict whose keys are all fields of ``config_class``."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict (JSON object), got {value!r}.")
    known = {f.name for f in fields(config_class)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {unknown}; accepted: {sorted(known)}.")


@dataclass
class KVTransferConfig:
    """A KV connector between engines (chapter 5: WAITING_FOR_REMOTE_KVS; chapter 10: P/D).

    The fields are vLLM's: ``kv_connector`` names the connector, ``kv_role``
    says whether this engine produces KV (the prefill server), consumes it
    (the decode server) or both; ``kv_ip``/``kv_port`` are where a producer's
    ranks listen (rank ``r`` on ``kv_port + r``); ``engine_id`` tells a
    restarted producer from the one that held the blocks;
    ``kv_load_failure_policy`` says what a consumer does when a load fails:
    end the request with an error ("fail", vLLM's default) or compute the
    prefill itself ("recompute").

    vLLM 0.32 counterpart: ``vllm/config/kv_transfer.py`` (``KVTransferConfig``).
    """

    kv_connector: str = ""
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # vLLM's default
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTOR_EXTRA_KEYS:
            raise ValueError(
                f"kv_connector must be one of {sorted(KV_CONNECTOR_EXTRA_KEYS)}, got {self.kv_connector!r}."
            )
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', got {self.kv_role!r}."
            )
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(
                f"kv_load_failure_policy must be 'fail' or 'recompute', got {self.kv_load_failure_policy!r}."
            )
        port = self.kv_port
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"kv_port must be an int in [1, 65535], got {port!r}.")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(f"kv_ip must be a host name or address, got {self.kv_ip!r}.")
        self._check_extra_config()

    def _check_extra_config(self) -> None:
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise TypeError(f"kv_connector_extra_config must be a dict, got {extra!r}.")
        accepted = KV_CONNECTOR_EXTRA_KEYS[self.kv_connector]
        unknown = sorted(set(extra) - set(accepted))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has unknown key(s) {unknown} for {self.kv_connector}; "
                f"accepted: {list(accepted)}."
            )
        if self.kv_connector == "SharedStorageConnector":
            path = extra.get("shared_storage_path")
            if not isinstance(path, str) or not path:
                raise ValueError(
                    "kv_connector_extra_config.shared_storage_path must be a non-empty path, "
                    f"got {path!r}."
                )
        for key in ("abort_request_timeout_s", "transfer_timeout_s"):
            value = extra.get(key, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds, "
                                 f"got {value!r}.")

    @classmethod
    def from_dict(cls, value: Any) -> KVTransferConfig:
        """vLLM's JSON form (``--kv-transfer-config``); an unknown key is an error naming it."""
        if isinstance(value, KVTransferConfig):
            return value
        check_config_dict("kv_transfer_config", cls, value)
        if "kv_connector" not in value:
            raise ValueError(f"kv_transfer_config needs kv_connector: one of {sorted(KV_CONNECTOR_EXTRA_KEYS)}.")
        return cls(**value)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def shared_storage_path(self) -> str:
        """The SharedStorageConnector's directory."""
        return str(self.kv_connector_extra_config["shared_storage_path"])

    @property
    def abort_request_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("abort_request_timeout_s", DEFAULT_ABORT_REQUEST_TIMEOUT_S))

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))


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
    # nanoengine's own (vLLM verifies every draft): "adaptive" verifies only the
    # drafts expected to pay for their rows (spec_decode/draft_length.py);
    # "fixed" verifies every draft, as vLLM does, and repeats run for run.
    draft_length: Literal["adaptive", "fixed"] = "adaptive"
    # vLLM's: [(first, last, k), ...], the draft length for each range of batch
    # sizes, e.g. [(1, 4, 5), (5, 16, 2), (17, 256, 0)]; None: k everywhere.
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None

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
        if self.draft_length not in ("adaptive", "fixed"):
            raise ValueError(f"draft_length must be 'adaptive' or 'fixed', got {self.draft_length!r}.")
        if self.num_speculative_tokens_per_batch_size is not None:
            self.num_speculative_tokens_per_batch_size = _batch_size_schedule(
                self.num_speculative_tokens_per_batch_size)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs beyond the tokens it verifies: a draft model
        writes the KV of its own guesses there; an n-gram search writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def _batch_size_schedule(entries: object) -> list[tuple[int, int, int]]:
    """vLLM's rules for ``num_speculative_tokens_per_batch_size``: a non-empty list
    of ``(first, last, k)``, positive ranges that do not overlap, the first from 1,
    every ``k`` at least 0 (0: no drafts at those batch sizes)."""
    if not isinstance(entries, list | tuple) or not entries:
        raise ValueError("num_speculative_tokens_per_batch_size must be a non-empty list of "
                         f"(first_batch_size, last_batch_size, num_speculative_tokens), got {entries!r}.")
    schedule = []
    for entry in entries:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise ValueError(f"each num_speculative_tokens_per_batch_size entry must be three ints, got {entry!r}.")
        first, last, k = entry
        if not 1 <= first <= last or k < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size entry {entry!r}: need "
                             "1 <= first_batch_size <= last_batch_size and num_speculative_tokens >= 0.")
        schedule.append((first, last, k))
    schedule.sort()
    if schedule[0][0] != 1:
        raise ValueError(f"num_speculative_tokens_per_batch_size must start at batch size 1, got {schedule[0]!r}.")
    for before, after in itertools.pairwise(schedule):
        if after[0] <= before[1]:
            raise ValueError(f"num_speculative_tokens_per_batch_size ranges {before!r} and {after!r} overlap.")
    return schedule


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
