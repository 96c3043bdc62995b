"""MultiprocExecutor (chapter 6, tensor parallelism): worker processes that answer, fail loudly and never linger.

Every test that starts workers starts real processes and proves afterwards
that none of them is left (``_no_new_processes``: the test process's
descendants before and after). Waits are bounded: a failure must surface as an
error within seconds, never as a hang.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
from hf_reference import EXACT_DTYPE, HFGreedy
from process_helpers import broken_checkpoint, descendants, pid_gone

from nanoengine import LLM, SamplingParams
from nanoengine.engine import arg_utils
from nanoengine.engine.core import EngineCore
from nanoengine.executor import multiproc_executor
from nanoengine.executor.multiproc_executor import MultiprocExecutor
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.utils.system_utils import usable_cpu_count

SMALL = {"max_model_len": 64, "kv_cache_memory_bytes": 1 << 22}
PROMPTS = [TokensPrompt(prompt_token_ids=list(range(10 + i, 30 + i))) for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@contextmanager
def _no_new_processes(seconds: float = 15.0) -> Iterator[None]:
    """Fail unless every process started inside the block is gone within ``seconds`` after it."""
    before = descendants()
    yield
    deadline = time.monotonic() + seconds
    while (left := descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {sorted(left)}"


def _core(llm: LLM) -> EngineCore:
    return llm.llm_engine.engine_core.get_engine_core()


def _executor(llm: LLM) -> MultiprocExecutor:
    executor = _core(llm).model_executor
    assert isinstance(executor, MultiprocExecutor)
    return executor


def _tokens(llm: LLM, prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_one_rank_in_a_process_gives_the_in_process_tokens(tiny_llama: str) -> None:
    expected = _tokens(LLM(tiny_llama, **SMALL), PROMPTS, GREEDY)
    with _no_new_processes():
        llm = LLM(tiny_llama, distributed_executor_backend="mp", **SMALL)
        try:
            executor = _executor(llm)
            (pid,) = [worker.process.pid for worker in executor.workers]
            assert pid != os.getpid() and psutil.pid_exists(pid)
            assert _tokens(llm, PROMPTS, GREEDY) == expected
            tree = str(llm.llm_engine)
            assert "model_executor: MultiprocExecutor" in tree and "tensor_parallel_size=1" in tree
            assert "workers[0]: WorkerProcHandle" in tree and f"rank=0 pid={pid}" in tree
            # A function runs as function(worker, *args); getattr is one pickle can send.
            assert executor.collective_rpc(getattr, args=("rank",)) == [0]
            assert executor.memory_profile is not None and executor.memory_profile.weights_bytes > 0
        finally:
            llm.llm_engine.shutdown()
        assert pid_gone(pid, 10.0)


def test_a_killed_worker_fails_the_next_step_at_once(tiny_llama: str) -> None:
    with _no_new_processes():
        llm = LLM(tiny_llama, distributed_executor_backend="mp", **SMALL)
        try:
            (worker,) = _executor(llm).workers
            os.kill(worker.process.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"Worker rank 0 \(pid \d+\) died: killed by SIGKILL"):
                _tokens(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            assert time.monotonic() - start < 5.0
            with pytest.raises(RuntimeError, match="executor has stopped"):  # and it stays stopped
                _executor(llm).collective_rpc("get_kv_cache_spec")
        finally:
            llm.llm_engine.shutdown()


def test_a_raising_worker_method_raises_in_the_engine(tiny_llama: str) -> None:
    with _no_new_processes():
        llm = LLM(tiny_llama, distributed_executor_backend="mp", **SMALL)
        executor = _executor(llm)
        pid = executor.workers[0].process.pid
        try:
            with pytest.raises(RuntimeError, match="Worker rank 0 raised in 'getattr':.*no attribute 'no_such_thing'"):
                executor.collective_rpc(getattr, args=("no_such_thing",))
            # The ranks may now disagree, so the workers are stopped and the engine raises.
            assert pid_gone(pid, 10.0)
            with pytest.raises(RuntimeError, match="no_such_thing"):
                _tokens(llm, PROMPTS[:1], GREEDY)
        finally:
            llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size must be a positive int"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be a positive int"),
        ({"tensor_parallel_size": 512}, r"tensor_parallel_size=512 needs 512 CPU cores .* this machine has \d+"),
        ({"distributed_executor_backend": "threads"}, r"must be one of \('uni', 'mp', 'ray'\)"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "'uni' runs one worker"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(
    tiny_llama: str, kwargs: dict[str, Any], message: str
) -> None:
    with _no_new_processes(seconds=0.0), pytest.raises(ValueError, match=message):
        LLM(tiny_llama, **SMALL, **kwargs)


def test_heads_that_do_not_split_are_refused_before_any_process_starts(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny Llama has 4 attention heads; pretend the machine has the cores for 3 ranks.
    monkeypatch.setattr("nanoengine.engine.arg_utils.usable_cpu_count", lambda: 8)
    with _no_new_processes(seconds=0.0), pytest.raises(ValueError, match=r"\(3\) must divide the number of attention heads \(4\)"):
        LLM(tiny_llama, tensor_parallel_size=3, **SMALL)


def test_a_worker_that_cannot_start_reports_its_error(tiny_llama: str, tmp_path: Path) -> None:
    broken = broken_checkpoint(tiny_llama, tmp_path)
    with _no_new_processes(), pytest.raises(RuntimeError, match=r"(?s)Worker rank 0 failed while starting:.*Traceback"):
        LLM(str(broken), distributed_executor_backend="mp", **SMALL)


def test_a_start_that_takes_too_long_is_a_timeout(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(multiproc_executor, "_READY_TIMEOUT_S", 0.05)
    with _no_new_processes(), pytest.raises(TimeoutError, match=r"Worker rank\(s\) \[0\] not ready after"):
        LLM(tiny_llama, distributed_executor_backend="mp", **SMALL)


_PARENT_SCRIPT = """
import sys, time
from nanoengine import LLM
llm = LLM(sys.argv[1], distributed_executor_backend="mp", max_model_len=64, kv_cache_memory_bytes=1 << 22)
executor = llm.llm_engine.engine_core.get_engine_core().model_executor
print(" ".join(str(worker.process.pid) for worker in executor.workers), flush=True)
if sys.argv[2] == "wait":
    time.sleep(120)
"""


def test_workers_end_with_their_parent_whether_it_exits_or_is_killed(tiny_llama: str) -> None:
    """Two parents at once (their engines start side by side): one returns from its
    script without shutdown(), one is SIGKILLed; neither leaves a worker behind."""
    parents = {
        how: subprocess.Popen([sys.executable, "-c", _PARENT_SCRIPT, tiny_llama, mode], stdout=subprocess.PIPE, text=True)
        for how, mode in (("exits without shutdown", "exit"), ("is killed", "wait"))
    }
    try:
        worker_pids = {}
        for how, parent in parents.items():
            assert parent.stdout is not None
            worker_pids[how] = [int(pid) for pid in parent.stdout.readline().split()]
            assert worker_pids[how], f"the parent that {how} printed no worker pid"
        parents["is killed"].kill()  # SIGKILL: no atexit, no finalizer -- only the workers' stdin tells them
        for how, parent in parents.items():
            assert parent.wait(30) is not None
            for pid in worker_pids[how]:
                assert pid_gone(pid, 15.0), f"worker {pid} outlived its parent, which {how}"
    finally:
        for parent in parents.values():
            parent.kill()
            parent.wait(10)


# ---- tensor parallelism end to end: the same greedy tokens as one rank and as HF --------------------

# Chunked prefill (32-token budget), mixed prompt lengths and a KV cache so small
# that requests are preempted and recomputed, all in one run.
CHUNKED_AND_PREEMPTED = {
    "max_num_batched_tokens": 32,
    "num_gpu_blocks_override": 25,
    "block_size": 4,
    "max_model_len": 96,
    "dtype": EXACT_DTYPE,
}


def _mixed_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for length in (5, 37, 3, 30, 9, 24)]


def _run(llm: LLM, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], int]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    tokens = _tokens(llm, [{"prompt_token_ids": p} for p in prompts], params)
    return tokens, _core(llm).scheduler.make_stats().num_preemptions


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_the_tokens_of_one_rank_and_of_hf(tiny_model_factory: Callable[..., str], arch: str) -> None:
    path = tiny_model_factory(arch, tie=arch == "llama")
    reference = HFGreedy(path)
    prompts = _mixed_prompts(reference.model.config.vocab_size)
    num_tokens = 24
    expected = [reference.generate(p, num_tokens) for p in prompts]
    one_rank, _ = _run(LLM(path, **CHUNKED_AND_PREEMPTED), prompts, num_tokens)
    assert one_rank == expected
    with _no_new_processes():
        llm = LLM(path, tensor_parallel_size=2, **CHUNKED_AND_PREEMPTED)
        try:
            assert [w.rank for w in _executor(llm).workers] == [0, 1]
            got, preemptions = _run(llm, prompts, num_tokens)
            assert got == expected
            assert preemptions > 0, "the tiny KV cache was meant to force preemption"
            # Again on the same engine: prefix-cache hits now skip part of each prompt.
            assert _run(llm, prompts, num_tokens)[0] == expected
        finally:
            llm.llm_engine.shutdown()


def test_two_ranks_with_async_scheduling_and_the_core_in_its_own_process(tiny_llama: str) -> None:
    """The executor inside the chapter-8 core process, with chapter 7's batch queue: same tokens."""
    expected = _tokens(LLM(tiny_llama, **SMALL), PROMPTS, GREEDY)
    with _no_new_processes():
        llm = LLM(tiny_llama, tensor_parallel_size=2, async_scheduling=True, multiprocess_mode=True, **SMALL)
        try:
            assert _tokens(llm, PROMPTS, GREEDY) == expected
            tree = str(llm.llm_engine)
            assert "workers[1]: WorkerProcHandle" in tree and "tensor_parallel_size=2" in tree
        finally:
            llm.llm_engine.shutdown()


@pytest.mark.default_model
def test_smollm2_on_three_ranks_gives_the_tokens_of_one(default_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M: 9 attention heads and 3 KV heads, one KV head per rank.

    EngineArgs refuses more CPU ranks than cores, and CI has two: the test
    lets three ranks share them (each rank takes one thread; slower, the same
    arithmetic), which a user is not allowed to do by accident.
    """
    monkeypatch.setattr(arg_utils, "usable_cpu_count", lambda: max(3, usable_cpu_count()))
    # A 256-token budget: the profiling pass of each rank runs a whole budget of tokens.
    settings = {"max_model_len": 256, "max_num_batched_tokens": 256, "dtype": EXACT_DTYPE, "device": "cpu"}
    texts = ["Hello", "What is the capital of France?", "List three prime numbers."]
    # 8 tokens: three oversubscribed ranks are slow, and a wrong split shows in the first token.
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = _tokens(LLM(default_model_path, **settings), texts, params)
    with _no_new_processes():
        llm = LLM(default_model_path, tensor_parallel_size=3, **settings)
        try:
            assert _tokens(llm, texts, params) == expected
        finally:
            llm.llm_engine.shutdown()


def test_two_ranks_speculate_with_ngram_drafts_and_keep_the_tokens(tiny_llama: str) -> None:
    """Chapter 9 across ranks: every rank drafts the same tokens from the same inputs,
    rank 0's drafts reach the scheduler (``take_draft_token_ids``), the tokens stay the same."""
    rng = random.Random(1)
    stretches = [[rng.randrange(3, 300) for _ in range(6)] for _ in range(4)]
    prompts = [stretch * 3 for stretch in stretches]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    expected, _ = _run(LLM(tiny_llama, **CHUNKED_AND_PREEMPTED), prompts, 24)
    with _no_new_processes():
        llm = LLM(tiny_llama, tensor_parallel_size=2, speculative_config=spec, **CHUNKED_AND_PREEMPTED)
        try:
            got, _ = _run(llm, prompts, 24)
            assert got == expected
            stats = _core(llm).scheduler.spec_decoding_stats
            assert stats is not None and stats.num_draft_tokens > 0
        finally:
            llm.llm_engine.shutdown()
