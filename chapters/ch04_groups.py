"""Chapter 4's KV cache groups in the walkthrough: every group's block table, and the hybrid run.

``block_table`` prints a request's block table in each KV cache group (one
group for a plain model). ``hybrid_run`` is experiment 4 of
``ch04_kv_cache``: it builds a hybrid model (Qwen3.5: Gated DeltaNet layers
beside full attention), prints the arithmetic that gives every group one page
size, read off the engine's ``KVCacheConfig``, and steps one request through
the engine, recording its blocks in every group after each step.

The code it reads: ``nanoengine/core/kv_cache_groups.py`` (the groups and the
block size), ``nanoengine/core/kv_cache_coordinator.py`` and
``single_type_kv_cache_manager.py`` (the tables). vLLM 0.32 counterpart: none
(a walkthrough; the code it shows mirrors ``vllm/v1/core/kv_cache_utils.py``
and ``vllm/v1/core/kv_cache_coordinator.py``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from rich.table import Table

from chapters._common import console, timed
from nanoengine import LLM, SamplingParams
from nanoengine.core.kv_cache_groups import ATTENTION_BLOCK_ALIGNMENT, align_hybrid_block_size
from nanoengine.core.kv_cache_utils import KVCacheBlock
from nanoengine.core.sched.scheduler import Scheduler
from nanoengine.kv_cache_interface import (
    FULL_ATTENTION_GROUP,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.transformers_utils.config import get_hf_config, resolve_model_path, trained_context_len
from nanoengine.utils.math_utils import cdiv

# Experiment 4 builds the notes' engine: Qwen3.5-0.8B (a config nanoengine ships,
# random weights), 4096 tokens of context, 1 GiB of KV cache.
HYBRID_MODEL = "Qwen/Qwen3.5-0.8B"
HYBRID_MAX_MODEL_LEN = 4096
HYBRID_KV_BYTES = 1 << 30
HYBRID_MAX_TOKENS = 4  # output tokens: the second decode step crosses into a third attention block


@dataclass
class HybridStep:
    """Experiment 4: the request's blocks after one engine step."""

    num_computed_tokens: int
    attention_block_ids: list[int]  # its table in the full-attention group
    state_block_ids: list[int]  # its one block in each state group, in group order
    num_free_blocks: int  # in the pool every group draws on


@dataclass
class HybridRun:
    """What experiment 4 observed."""

    block_size: int  # the attention block size the groups agreed on
    steps: list[HybridStep]  # while the request ran, one per engine step
    num_free_blocks_after: int  # once it finished
    num_usable_blocks: int  # the pool, less its null block
    build_seconds: float
    run_seconds: float


def block_table(scheduler: Scheduler, request_id: str) -> Table:
    """One request's block tables, a section per KV cache group: which tokens each
    block holds, its ref count and hash. A plain model has one group; a hybrid
    model's state groups hold one block each, the request's state.
    """
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    table = Table(title=f"block table of request {request_id!r} (a section per KV cache group)")
    for column in ("group", "#", "block id", "tokens", "ref_cnt", "hash"):
        table.add_column(column)
    for group, blocks in zip(
        coordinator.single_type_managers, coordinator.get_blocks(request_id), strict=True
    ):
        is_state = isinstance(group.kv_cache_spec, MambaSpec)
        kind = "state, 1 block per request" if is_state else f"{kind_of(group.kv_cache_spec)}, {group.block_size} tokens/block"
        label = f"{group.kv_cache_group_id}: {kind}"
        for index, block in enumerate(blocks):
            first = index * group.block_size
            table.add_row(
                label if index == 0 else "",
                str(index),
                str(block.block_id),
                "the whole request, as one state" if is_state else f"{first}-{first + group.block_size - 1}",
                str(block.ref_cnt),
                "(the null block: given back)" if block is manager.block_pool.null_block
                else _hash_cell(block, manager.enable_caching and not is_state),
                end_section=index == len(blocks) - 1,
            )
    return table


def kind_of(spec: KVCacheSpec) -> str:
    """A K/V group's kind in words: full attention, or a sliding window of so many tokens."""
    if isinstance(spec, SlidingWindowSpec):
        return f"sliding window of {spec.sliding_window} tokens"
    return "full attention"


def _hash_cell(block: KVCacheBlock, cacheable: bool) -> str:
    """The block's hash, or why it has none."""
    if block.block_hash is not None:
        return block.block_hash.hex()[:10]
    return "(not full yet)" if cacheable else "(never cached)"


def hybrid_run(model: str, requested_block_size: int, max_num_batched_tokens: int) -> HybridRun:
    """Experiment 4: a hybrid model's page arithmetic, then one request step by step."""
    console.print(
        f"4. building {model} with random weights (load_format='dummy', fp32); "
        "Qwen3.5-0.8B takes a minute or more on a small CPU ..."
    )
    # The notes' 4096 tokens, or the model's own context if that is shorter (a tiny test model's).
    context = trained_context_len(get_hf_config(resolve_model_path(model, "dummy")))
    llm, build_seconds = timed(
        lambda: LLM(
            model,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=requested_block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=min(HYBRID_MAX_MODEL_LEN, context),
            kv_cache_memory_bytes=HYBRID_KV_BYTES,
        )
    )
    core = llm.llm_engine.engine_core.get_engine_core()
    config = core.kv_cache_config
    if config.num_state_groups == 0:
        raise SystemExit(
            f"{model} has no state layers: experiment 4 needs a hybrid model (or --hybrid-model none)."
        )
    console.print(f"built in {build_seconds:.1f} s")
    kv_bytes = core.engine_config.cache_config.kv_cache_memory_bytes
    assert kv_bytes is not None  # set above
    console.print(layout_table(config, requested_block_size, kv_bytes), groups_table(config))
    steps, run_seconds = timed(lambda: step_one_request(llm, config))
    pool = core.scheduler.kv_cache_manager.block_pool
    console.print(
        f"the request finished ({run_seconds:.1f} s of steps); the pool has {pool.get_num_free_blocks()} "
        f"of its {pool.num_usable_blocks} blocks free again.\n"
    )
    return HybridRun(
        block_size=config.block_size,
        steps=steps,
        num_free_blocks_after=pool.get_num_free_blocks(),
        num_usable_blocks=pool.num_usable_blocks,
        build_seconds=build_seconds,
        run_seconds=run_seconds,
    )


def layout_table(config: KVCacheConfig, requested_block_size: int, kv_bytes: int) -> Table:
    """The page-size arithmetic, every number read off the engine's KV cache config."""
    attention = config.spec
    state = next(g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec))
    per_token = replace(attention, block_size=1).page_size_per_layer
    # The engine's own rule, fed the live numbers, gives the block size the engine runs with.
    assert align_hybrid_block_size(requested_block_size, per_token, state.state_bytes) == config.block_size
    step, state_bytes, page = ATTENTION_BLOCK_ALIGNMENT, state.state_bytes, config.page_size_per_layer
    conv, ssm = (" x ".join(map(str, shape)) for shape in state.shapes)
    needed = cdiv(state_bytes, step * per_token)  # steps of 16 tokens whose K and V hold a state
    block_size_sum = (
        f"max(asked {requested_block_size}, {step} x cdiv({state_bytes:,}, {step} x {per_token:,}))"
        f" = max({requested_block_size}, {step} x {needed})"
    )
    rows = [
        (
            "K+V of one token, one attention layer (B)",
            f"2 x {attention.num_kv_heads} KV heads x head_dim {attention.head_dim} x {attention.dtype_size} B",
            per_token,
        ),
        (
            "state of one request, one state layer (B)",
            f"(conv {conv} + ssm {ssm}) x {state.dtype_size} B",
            state_bytes,
        ),
        ("block size (tokens)", block_size_sum, config.block_size),
        ("page, one layer, every group (B)", f"{config.block_size} tokens x {per_token:,} B", page),
        ("padding of each state page (B)", f"{page:,} - {state_bytes:,}", page - state_bytes),
        (
            "shared tensors",
            f"layers in the largest group; tensor 0 holds layers {config.kv_cache_tensors[0].shared_by}",
            config.num_shared_tensors,
        ),
        (
            "one block id (B)",
            f"{config.num_shared_tensors} shared tensors x {page:,} B",
            config.bytes_per_block,
        ),
        ("blocks in the pool", f"{kv_bytes:,} B // {config.bytes_per_block:,} B", config.num_blocks),
    ]
    table = Table(title="4. one page size for every group: this engine's arithmetic")
    for column in ("quantity", "arithmetic", "value"):
        table.add_column(column, justify="right" if column == "value" else "left")
    for quantity, arithmetic, value in rows:
        table.add_row(quantity, arithmetic, f"{value:,}")
    return table


def groups_table(config: KVCacheConfig) -> Table:
    """The KV cache groups: which layers, what kind, how many tokens a block stands for."""
    table = Table(
        title=f"{len(config.kv_cache_groups)} KV cache groups over one pool of {config.num_blocks} blocks"
    )
    for column in ("group", "kind", "layers", "tokens per block"):
        table.add_column(column)
    for group_id, group in enumerate(config.kv_cache_groups):
        is_state = isinstance(group.kv_cache_spec, MambaSpec)
        table.add_row(
            str(group_id),
            "state (Gated DeltaNet)" if is_state else kind_of(group.kv_cache_spec),
            " ".join(map(str, group.layer_indices)),
            f"{group.kv_cache_spec.block_size} (= max_model_len)"
            if is_state
            else str(group.kv_cache_spec.block_size),
        )
    return table


def step_one_request(llm: LLM, config: KVCacheConfig) -> list[HybridStep]:
    """Chunked prefill of a prompt one token short of two attention blocks, then a few
    decode steps: the attention table grows, each state group keeps its one block.
    """
    engine = llm.llm_engine
    scheduler = engine.engine_core.get_engine_core().scheduler
    rng = random.Random(0)  # random weights, so any token ids will do
    vocab_size = engine.engine_config.model_config.vocab_size
    prompt = [rng.randrange(vocab_size) for _ in range(2 * config.block_size - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=HYBRID_MAX_TOKENS, ignore_eos=True)
    engine.add_request("h", TokensPrompt(prompt_token_ids=prompt), params)
    budget = engine.engine_config.scheduler_config.max_num_batched_tokens
    console.print(
        f"one request: {len(prompt)} prompt tokens in chunks of up to {budget}, then {HYBRID_MAX_TOKENS} "
        "output tokens; each line is one engine step (seconds each on the 0.8B model)"
    )
    steps: list[HybridStep] = []
    while engine.has_unfinished_requests():
        _, seconds = timed(engine.step)
        request = scheduler.requests.get("h")
        if request is None:  # finished: its blocks went back to the pool in this step
            break
        tables = scheduler.kv_cache_manager.get_block_ids("h")
        step = HybridStep(
            request.num_computed_tokens,
            tables[FULL_ATTENTION_GROUP],
            [table[0] for group_id, table in enumerate(tables) if group_id not in config.attention_group_ids],
            scheduler.kv_cache_manager.num_free_blocks,
        )
        steps.append(step)
        console.print(
            f"  step {len(steps)} ({seconds:.1f} s): {step.num_computed_tokens:>5} tokens computed | attention "
            f"blocks {step.attention_block_ids} | state blocks {step.state_block_ids} | free {step.num_free_blocks}"
        )
        if step.num_computed_tokens == len(prompt):  # the prompt is in: every group's table
            console.print(block_table(scheduler, "h"))
    return steps
