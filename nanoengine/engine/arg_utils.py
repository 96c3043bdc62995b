"""EngineArgs: the flat keyword arguments of ``LLM(...)`` turned into an EngineConfig.

Chapter 6 (``LLM(...)`` construction) starts here: before any weight is read, the
user's keywords are checked and the model's config.json is read to learn its
shape and its longest context. vLLM 0.32 counterpart: ``vllm/engine/arg_utils.py``
(``EngineArgs.create_engine_config``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import types
from dataclasses import dataclass, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from nanoengine.attention.selector import BACKEND_NAMES
from nanoengine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_config_dict,
)
from nanoengine.distributed.utils import check_tensor_parallel_size
from nanoengine.executor.abstract import EXECUTOR_CLASSES, Executor
from nanoengine.model_executor.layers.cpu_linear import LINEAR_BACKENDS
from nanoengine.model_executor.model_loader.loader import LOAD_FORMATS
from nanoengine.model_executor.models.registry import get_model_class
from nanoengine.platforms.cpu import default_cpu_dtype
from nanoengine.transformers_utils.config import get_hf_config, resolve_model_path, trained_context_len
from nanoengine.transformers_utils.gguf_config import resolve_weights
from nanoengine.utils.system_utils import usable_cpu_count

logger = logging.getLogger(__name__)

# The distributed_executor_backend values (executor/abstract.py maps them to classes).
_EXECUTOR_BACKENDS = tuple(EXECUTOR_CLASSES)
# The dtypes a user may name; "auto" picks bf16 on CUDA and on a CPU with bf16
# dot products, fp32 on other CPUs (nanoengine/platforms/cpu.py).
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineArgs:
    """Every keyword ``LLM(...)`` accepts, with vLLM's names."""

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # None: 128 tokens on the CPU, 16 on CUDA (the defaults vLLM 0.32 picks).
    block_size: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    cpu_kv_cache_fraction: float = 0.1
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    linear_backend: Literal["auto", "torch", "onednn", "cpu"] = "auto"
    cudagraph_capture_sizes: list[int] | None = None
    # Chapter 7: overlap the next step's scheduling with this step's forward pass.
    async_scheduling: bool = False
    # Chapters 3-4: record a StepTrace per step (llm.trace); check the KV cache
    # and scheduler invariants after every step. The environment variables
    # NANOENGINE_TRACE=1 / NANOENGINE_CHECK_INVARIANTS=1 turn them on too.
    trace: bool = False
    check_invariants: bool = False
    # Chapter 6: "dummy" fills the model with seeded random values instead of
    # reading its weights (real shapes, memory and speed; meaningless text), and
    # can run a model nanoengine ships the config of (Qwen/Qwen3.5-0.8B).
    load_format: Literal["auto", "dummy"] = "auto"
    # Chapter 6: load no tokenizer; prompts are token ids, outputs have empty text.
    skip_tokenizer_init: bool = False
    # Chapters 2 and 6: "gguf" keeps llama.cpp's quantized blocks (inferred from a .gguf model path).
    quantization: Literal["gguf"] | None = None
    # Chapter 6: split every layer over N ranks (devices, or shares of a CPU's
    # cores), one worker each. The backend starts the workers: "uni" (one rank,
    # in this process), "mp" (a process per rank) or "ray"; None picks as vLLM
    # does, "uni" for one rank and "mp" for more.
    tensor_parallel_size: int = 1
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    trust_remote_code: bool = False
    tokenizer: str | None = None
    # A KV connector (prefill/decode disaggregation), chapters 5 and 10: vLLM's
    # dict, e.g. {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"} (or a
    # KVTransferConfig); on the command line, --kv-transfer-config with the JSON.
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None = None
    # Chapter 8: run the engine core in a process of its own, behind ZMQ sockets
    # (NANOENGINE_ENABLE_MULTIPROCESSING=1 too; vLLM's switch is
    # VLLM_ENABLE_V1_MULTIPROCESSING, on by default there, off here).
    multiprocess_mode: bool = False
    # Chapter 9: speculative decoding, as vLLM spells it: a dict such as
    # {"method": "ngram", "num_speculative_tokens": 3} (or a SpeculativeConfig);
    # on the command line, --speculative-config with the dict as JSON.
    speculative_config: dict[str, Any] | SpeculativeConfig | None = None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One ``--kebab-case`` flag per field, typed from its annotation (``nanoengine serve``).

        vLLM's own flags have the same names, so ``--max-model-len 512`` or
        ``--no-enable-prefix-caching`` mean the same thing to both servers.
        """
        hints = get_type_hints(cls)
        group = parser.add_argument_group("engine arguments")
        for field in fields(cls):
            if field.name in _NOT_ON_THE_COMMAND_LINE:
                continue
            flag = "--" + field.name.replace("_", "-")
            kind, choices, is_list = _cli_type(hints[field.name])
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
            else:
                group.add_argument(flag, type=kind, choices=choices, nargs="+" if is_list else None,
                                   default=None if is_list else field.default)
        group.add_argument("--speculative-config", type=json.loads, default=None,
                           help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
        group.add_argument("--kv-transfer-config", type=json.loads, default=None,
                           help='a KV connector as JSON, e.g. \'{"kv_connector": "ZmqConnector", '
                                '"kv_role": "kv_producer", "kv_port": 14579}\'')

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The parsed flags (``args.model`` included) back into engine arguments."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**values)

    def use_multiprocessing(self) -> bool:
        """Whether the engine core gets a process of its own (the argument or the env var)."""
        return self.multiprocess_mode or _env_flag("NANOENGINE_ENABLE_MULTIPROCESSING")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        """Build from ``LLM(model, **kwargs)``; an unknown keyword is a TypeError
        that lists the accepted ones, instead of being silently ignored.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {unknown}. Accepted: {sorted(known)}."
            )
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        """Check the arguments, read the model's config and size the scheduler."""
        self._verify_args()
        model_path, gguf_file = resolve_weights(self.model, self.quantization, self.load_format)
        hf_config = get_hf_config(model_path)
        device = _resolve_device(self.device)
        max_model_len = _resolve_max_model_len(hf_config, self.max_model_len)
        get_model_class(hf_config)  # fails early, naming the architecture, before any weight is read
        model_config = ModelConfig(
            model=self.model,
            model_path=model_path,
            hf_config=hf_config,
            max_model_len=max_model_len,
            dtype=resolve_dtype(self.dtype, device),
            seed=self.seed,
            attention_backend=self.attention_backend,
            linear_backend=self.linear_backend,
            enforce_eager=self.enforce_eager,
            cudagraph_capture_sizes=self.cudagraph_capture_sizes,
            load_format=self.load_format,
            skip_tokenizer_init=self.skip_tokenizer_init,
            quantization="gguf" if gguf_file else None,
            gguf_file=gguf_file,
        )
        enable_prefix_caching = resolve_prefix_caching(self.enable_prefix_caching, model_config)
        kv_transfer_config = self._kv_transfer_config(model_config, enable_prefix_caching)
        parallel_config = self._parallel_config(model_config, device)
        engine_config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=_resolve_block_size(self.block_size, device),
                enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                cpu_kv_cache_fraction=self.cpu_kv_cache_fraction,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler_config=self._scheduler_config(max_model_len),
            device_config=DeviceConfig(device=device),
            parallel_config=parallel_config,
            kv_transfer_config=kv_transfer_config,
            observability_config=ObservabilityConfig(
                trace=self.trace or _env_flag("NANOENGINE_TRACE"),
                check_invariants=self.check_invariants or _env_flag("NANOENGINE_CHECK_INVARIANTS"),
            ),
            speculative_config=self._speculative_config(model_config),
        )
        # An executor that cannot be imported ("ray" without Ray) fails here,
        # before any process starts.
        Executor.get_class(engine_config)
        return engine_config

    def _parallel_config(self, model_config: ModelConfig, device: str) -> ParallelConfig:
        """The ranks and who starts them, checked against the model and the machine.

        Everything a rank count can get wrong is refused here, while the engine
        is still one process: a worker that fails to split its model would
        fail in every process at once, far from the argument that caused it.
        """
        size = self.tensor_parallel_size
        backend = self.distributed_executor_backend or ("uni" if size == 1 else "mp")
        if backend == "uni" and size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one worker in this process, but "
                f"tensor_parallel_size={size} needs {size}; use 'mp' or 'ray'."
            )
        devices, what = _parallel_device_count(device)
        # Ray ranks may live on other machines: its placement group counts the
        # whole cluster's devices when the executor starts (as vLLM leaves it to Ray).
        if backend != "ray" and size > devices:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} {what}, but this machine has {devices}."
            )
        check_tensor_parallel_size(model_config.hf_text_config, size)
        if model_config.quantization == "gguf" and size > 1:
            raise ValueError(f"quantization='gguf' runs on one rank in nanoengine; tensor_parallel_size={size} "
                             "would split rows of blocks across ranks.")
        return ParallelConfig(tensor_parallel_size=size, distributed_executor_backend=backend)

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        # Without chunked prefill a whole prompt must fit into one step's budget,
        # so the budget can be no smaller than the longest prompt.
        budget = self.max_num_batched_tokens or (2048 if self.enable_chunked_prefill else max_model_len)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}; "
                "without chunked prefill a whole prompt must fit in one step. Raise "
                "max_num_batched_tokens or enable chunked prefill."
            )
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
        )

    def _verify_args(self) -> None:
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
        }
        for name, value in positive.items():
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if not 0.0 < self.cpu_kv_cache_fraction <= 1.0:
            raise ValueError(f"cpu_kv_cache_fraction must be in (0, 1], got {self.cpu_kv_cache_fraction}.")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {self.attention_backend!r}.")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}.")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(n, int) or n < 1 for n in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of positive ints, got {sizes!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.use_multiprocessing() and (self.trace or _env_flag("NANOENGINE_TRACE")):
            # The trace is a live object in the core's process (chapters 3-4 read it in place).
            raise ValueError("trace=True (or NANOENGINE_TRACE=1) needs the in-process engine: "
                             "drop multiprocess_mode (and NANOENGINE_ENABLE_MULTIPROCESSING).")
        if self.async_scheduling and (self.trace or _env_flag("NANOENGINE_TRACE")):
            # A StepTrace records one step from schedule to update; with async
            # scheduling the next step is scheduled before this one's update.
            raise ValueError("trace=True (or NANOENGINE_TRACE=1) does not work with async_scheduling=True.")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}.")
        if self.distributed_executor_backend not in (None, *_EXECUTOR_BACKENDS):
            raise ValueError(
                f"distributed_executor_backend must be one of {_EXECUTOR_BACKENDS} (or None: 'uni' for one "
                f"rank, 'mp' for more), got {self.distributed_executor_backend!r}."
            )


    def _kv_transfer_config(self, model_config: ModelConfig, enable_prefix_caching: bool) -> KVTransferConfig | None:
        """The ``kv_transfer_config`` argument checked, as a KVTransferConfig (chapters 5 and 10).

        The storage connector names stored blocks by their prefix hashes, which
        only exist with prefix caching, and stores whole blocks, which a
        tensor-parallel rank does not hold. The network connector needs neither
        (each rank sends its own slice), but both move full-attention K/V only,
        so a hybrid model is refused.
        """
        if self.kv_transfer_config is None:
            return None
        config = KVTransferConfig.from_dict(self.kv_transfer_config)
        if model_config.has_state_layers:
            raise ValueError(f"kv_transfer_config is not supported for the hybrid model {model_config.model}: "
                             "the connectors move full-attention K/V blocks, not linear-attention states.")
        if model_config.sliding_window is not None:
            raise ValueError(f"kv_transfer_config is not supported for {model_config.model}, whose layers use "
                             f"sliding_window={model_config.sliding_window}: the connectors move every block of "
                             "one full-attention table, and a sliding window gives its early blocks back.")
        if config.kv_connector == "SharedStorageConnector":
            if not enable_prefix_caching:
                raise ValueError("kv_transfer_config: SharedStorageConnector needs enable_prefix_caching=True "
                                 "(blocks are keyed by hash).")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_transfer_config: SharedStorageConnector works with tensor_parallel_size=1 "
                                 f"only, got {self.tensor_parallel_size} (it stores whole blocks).")
        return config

    def _speculative_config(self, model_config: ModelConfig) -> SpeculativeConfig | None:
        """The ``speculative_config`` argument checked, as a SpeculativeConfig (chapter 9).

        Refused, each with the reason: async scheduling (the next step would be
        scheduled before this step's drafts exist; vLLM keeps them in the
        worker, nanoengine does not) and a hybrid model (a Gated DeltaNet
        layer's state has no per-token history to roll back over rejected drafts).
        """
        value = self.speculative_config
        if value is None:
            return None
        config = value if isinstance(value, SpeculativeConfig) else _speculative_config_from_dict(value)
        if self.async_scheduling:
            raise ValueError("speculative_config does not work with async_scheduling=True in nanoengine: "
                             "the drafts of one step are scheduled with the next.")
        if model_config.has_state_layers:
            raise ValueError(f"speculative_config is not supported for the hybrid model {model_config.model}: "
                             "its linear-attention state cannot be rolled back over rejected drafts.")
        if config.method == "draft_model":
            _check_draft_model(config, model_config, self.tensor_parallel_size)
        return config


def _check_draft_model(config: SpeculativeConfig, target: ModelConfig, tensor_parallel_size: int) -> None:
    """A draft model must speak the target's vocabulary, and run on one rank here."""
    assert config.model is not None
    if tensor_parallel_size > 1:
        raise ValueError("method='draft_model' works with tensor_parallel_size=1 only in nanoengine.")
    draft = dataclasses.replace(target, hf_config=get_hf_config(resolve_model_path(config.model, target.load_format)))
    get_model_class(draft.hf_config)  # an architecture nanoengine cannot run fails here, by name
    if set(draft.layer_types) != {"full_attention"}:
        raise ValueError(f"draft model {config.model!r} has {sorted(set(draft.layer_types))} layers; "
                         "a draft must have full attention only.")
    if target.sliding_window is not None:
        raise ValueError(f"method='draft_model' does not work with {target.model!r}, whose layers use "
                         f"sliding_window={target.sliding_window}: the draft keeps its K/V in the target's "
                         "blocks, and a sliding window gives early blocks back.")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {config.model!r} has vocab_size={draft.vocab_size}, the target {target.model!r} has "
            f"{target.vocab_size}: a draft must use the target's tokenizer."
        )


def _speculative_config_from_dict(value: Any) -> SpeculativeConfig:
    """vLLM's dict form; an unknown key is an error naming the accepted ones."""
    check_config_dict("speculative_config", SpeculativeConfig, value)
    return SpeculativeConfig(**value)


def _parallel_device_count(device: str) -> tuple[int, str]:
    """How many ranks this machine can give one each: (count, what they are, in words).

    A CPU rank needs at least one core of its own (the ranks share the cores,
    ``torch.set_num_threads`` splits them); a CUDA rank needs a GPU of its own.
    """
    if device == "cuda":
        import torch  # deferred, as in _resolve_device

        return torch.cuda.device_count(), "visible GPUs"
    return usable_cpu_count(), "CPU cores (one per rank)"


# Fields the command line does not set field by field: the model is positional,
# and --kv-transfer-config and --speculative-config take JSON (added by hand in
# add_cli_args).
_NOT_ON_THE_COMMAND_LINE = ("model", "kv_transfer_config", "speculative_config")


def _cli_type(annotation: Any) -> tuple[type, list[str] | None, bool]:
    """(argparse type, choices, is a list) for one field's annotation."""
    is_union = get_origin(annotation) in (Union, types.UnionType)
    inner = next(arg for arg in get_args(annotation) if arg is not type(None)) if is_union else annotation
    if get_origin(inner) is Literal:
        return str, list(get_args(inner)), False
    if get_origin(inner) is list:
        return get_args(inner)[0], None, True
    return inner, None, False


def _env_flag(name: str) -> bool:
    """True when the environment variable is set to 1/true/yes/on (any case)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _resolve_device(device: str) -> str:
    import torch  # deferred: keeps `import nanoengine.engine.arg_utils` light

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device.")
    return device


def _resolve_block_size(block_size: int | None, device: str) -> int:
    """Tokens per KV block: the user's choice, else 128 on the CPU, 16 on CUDA.

    A CPU decode step reads every cached K/V row from DRAM, and blocks lie
    wherever the pool put them. 16-token blocks (12 KiB of one layer's keys for
    SmolLM2) break that read into short runs the hardware prefetcher must
    restart; 128-token blocks make the runs eight times longer (chapter 7). On a
    GPU, 16 keeps the paged kernels' tiles small. vLLM 0.32's ``CpuPlatform``
    picks the same 128.
    """
    if block_size is not None:
        return block_size
    return 128 if device == "cpu" else 16


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype a model runs in: the user's, or for "auto" bf16 on CUDA and on a
    CPU with bf16 dot products, fp32 on other CPUs (chapter 6)."""
    if dtype == "auto":
        return default_cpu_dtype() if device == "cpu" else "bfloat16"
    return dtype


def resolve_prefix_caching(requested: bool, model_config: ModelConfig) -> bool:
    """Prefix caching as asked, except for a hybrid model: off, said once in the log.

    A cache hit skips the forward pass of the prefix, so every layer must get
    back what it held at the prefix's end. A full-attention layer can: the K
    and V of each full block stay in the pool. A Gated DeltaNet layer keeps one
    state per request, overwritten at every step, so its state at a block
    boundary is gone before another request could reuse it. vLLM 0.32 caches
    hybrid models only in its "align" mode, which saves a state at every block
    boundary; nanoengine keeps one state per request (chapter 4).
    """
    if requested and model_config.has_state_layers:
        logger.info(
            "Prefix caching is off for %s: it is a hybrid model, and its linear-attention layers keep "
            "one recurrent state per request, not one per block (vLLM's 'align' mode).",
            model_config.model,
        )
        return False
    return requested


def _resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    """The model's trained context unless the user asks for less (never more)."""
    trained = trained_context_len(hf_config)
    if requested is None:
        return trained
    if requested > trained:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's max_position_embeddings={trained}."
        )
    return requested
