"""The engine core in its own process (chapter 8): same tokens, no process left behind, no hang.

Every test starts real processes (``multiprocessing`` spawn, ZMQ over ipc://)
and proves they are gone afterwards.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nanoengine import LLM, SamplingParams
from nanoengine.engine import EngineCoreRequest, FinishReason
from nanoengine.engine.core_client import SyncMPClient
from nanoengine.engine.exceptions import EngineDeadError
from nanoengine.renderers.hf import TokensPrompt

SMALL = {"max_model_len": 64, "kv_cache_memory_bytes": 1 << 22}
PROMPTS = [TokensPrompt(prompt_token_ids=list(range(10 + i, 30 + i))) for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) is gone for every purpose here.
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "State:\tZ" not in status.read_text()


def _wait_until_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _is_running(pid):
            return True
        time.sleep(0.05)
    return False


def _client(llm: LLM) -> SyncMPClient:
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    return client


def test_same_tokens_as_in_process_and_the_tree_crosses_the_boundary(tiny_llama: str) -> None:
    expected = [o.outputs[0].token_ids for o in LLM(tiny_llama, **SMALL).generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(tiny_llama, multiprocess_mode=True, **SMALL)
    client = _client(llm)
    pid = client.core_process.pid
    assert pid is not None and pid != os.getpid()
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == expected
        tree = str(llm.llm_engine)
        assert "engine_core: SyncMPClient" in tree and "engine_core: EngineCoreProc" in tree
        assert f"in process {pid}" in tree and "block_pool: BlockPool" in tree
        with pytest.raises(RuntimeError, match="another process"):
            client.get_engine_core()
    finally:
        llm.llm_engine.shutdown()
    assert _wait_until_gone(pid, 5.0), f"core process {pid} outlived shutdown()"


def test_a_request_the_core_cannot_decode_ends_with_an_error_and_the_core_goes_on(tiny_llama: str) -> None:
    """The core re-checks every request it decodes; one it refuses must answer, not vanish (found by
    fuzzing the server: the core's input thread died, and every later request waited forever)."""
    llm = LLM(tiny_llama, multiprocess_mode=True, **SMALL)
    client = _client(llm)
    try:
        broken = SamplingParams(temperature=0.0, max_tokens=5)
        broken.min_tokens = 10  # past SamplingParams' own check, as a front-end bug could let it
        client.add_request(EngineCoreRequest("broken", [1, 2, 3], broken, eos_token_id=None))
        (refused,) = client.get_output().outputs
        assert refused.request_id == "broken" and refused.finish_reason == FinishReason.ERROR
        assert refused.finish_message is not None and "min_tokens" in refused.finish_message
        (after,) = llm.generate(["hello"], GREEDY, use_tqdm=False)
        assert after.outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()


def test_env_var_turns_it_on_and_trace_is_refused(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="in-process engine"):
        LLM(tiny_llama, multiprocess_mode=True, trace=True, **SMALL)
    monkeypatch.setenv("NANOENGINE_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(tiny_llama, **SMALL)
    try:
        pid = _client(llm).core_process.pid
        assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].finished
    finally:
        llm.llm_engine.shutdown()
    assert pid is not None and _wait_until_gone(pid, 5.0)


def test_killed_core_raises_engine_dead_error_instead_of_hanging(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, multiprocess_mode=True, **SMALL)
    pid = _client(llm).core_process.pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        long_run = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="exited with code"):
            llm.generate(PROMPTS, long_run, use_tqdm=False)
        assert time.monotonic() - start < 5.0
        with pytest.raises(EngineDeadError):  # and it stays dead, loudly
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


# A parent that keeps its engine busy until it is killed. "tp2": the core drives two
# worker processes (MultiprocExecutor); "held": the parent first forks a child that
# keeps the core's stdin pipe open, so the core never reads end-of-file and must
# notice that it was handed to a new parent instead.
_ORPHAN_SCRIPT = """
import os, sys, time
from nanoengine import LLM, SamplingParams
from nanoengine.renderers.hf import TokensPrompt
case = sys.argv[2]
llm = LLM(sys.argv[1], multiprocess_mode=True, tensor_parallel_size=2 if case == "tp2" else 1,
          max_model_len=64, kv_cache_memory_bytes=1 << 22)
holder = os.fork() if case == "held" else None
if holder == 0:
    time.sleep(60)
    os._exit(0)
print(llm.llm_engine.engine_core.core_process.pid, holder or 0, flush=True)
busy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
while True:
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])] * 4, busy, use_tqdm=False)
"""


@pytest.mark.parametrize("case", ["tp2", "held"])
def test_a_busy_core_and_its_ranks_exit_when_the_parent_is_killed(tiny_llama: str, case: str) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, tiny_llama, case], stdout=subprocess.PIPE,
                              text=True)
    holder = 0
    try:
        assert parent.stdout is not None
        core_pid, holder = map(int, parent.stdout.readline().split())
        engine_pids = [core_pid, *(child.pid for child in psutil.Process(core_pid).children(recursive=True))]
        assert len(engine_pids) == (3 if case == "tp2" else 1), engine_pids
        time.sleep(0.5)  # mid-generation
        parent.kill()  # SIGKILL: no atexit handler, no shutdown() -- only the pipe or the new parent tells the core
        parent.wait(10)
        alive = [pid for pid in engine_pids if not _wait_until_gone(pid, 10.0)]
        assert not alive, f"engine processes {alive} outlived their killed parent ({case})"
    finally:
        parent.kill()
        parent.wait(10)
        if holder:
            os.kill(holder, signal.SIGKILL)
