"""The step traces the docs site replays: one short run per chapter, recorded from the real engine.

Chapters 3 (scheduler), 4 (KV cache manager), 5 (engine skeleton), 9
(speculative decoding) and 10 (disaggregated prefill and decode). The docs
hook (``docs/hooks/main.py``) records them when the site is built, so a
replay always shows what today's engine does;
each page embeds its trace with ``{{ step_trace("ch03") }}`` and the step
viewer of ``nanoengine/instruments/live_view/`` draws it with a scrub bar.

Each run uses the tiny random-weight Llama of the grader (two layers, a
320-token vocabulary): scheduling and KV blocks do not depend on what the
weights say, only on token counts, so the pictures are those of any model
with these settings, recorded in a second. Arrivals are given by step, so a
run reads the same every time (chapter 10's excepted: how many steps a pull
over TCP takes depends on the machine):

* ``ch03``: six requests against a 32-token budget and a small KV cache:
  chunked prefills beside decodes, then a preemption;
* ``ch04``: three requests sharing a 48-token prefix, arriving one after
  another: prefix-cache hits, blocks shared (ref count 2), cached blocks
  evicted once the pool runs short;
* ``ch05``: the states of a request's life: streaming input
  (WAITING_FOR_STREAMING_REQ), an abort, a stop token, a length cap;
* ``ch09``: ngram speculation on chapter 9's "repeat this text" prompt:
  drafts proposed and accepted per step. This one runs SmolLM2 (``make
  model`` prepares it): a random model never repeats its context, so its
  drafts would all be rejected;
* ``ch10-producer`` and ``ch10-consumer`` (``record_disaggregated``): a
  prefill engine and a decode engine in this process, the KV crossing over
  loopback TCP (the ZmqConnector): the producer's blocks held after its
  requests finish, then freed once read; the consumer's requests waiting in
  WAITING_FOR_REMOTE_KVS while their blocks arrive; the second prompt shares
  a prefix with the first and leaves once the first decodes, so the
  consumer finds that prefix cached and pulls only the blocks it lacks.

    python -m chapters.step_traces --out DIR [NAME ...]

vLLM 0.32 counterpart: none.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chapters.ch09_spec_decode import BY_HAND_PROMPT
from chapters.grade_checks.tiny_model import tiny_llama_model_dir
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.instruments.live_view.offline import record_frames, save_trace
from nanoengine.request import RequestStatus
from nanoengine.sampling_params import SamplingParams
from nanoengine.transformers_utils.config import resolve_model_path
from nanoengine.utils.system_utils import get_open_port

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# What a trace of the tiny random-weight model says it ran.
TINY_MODEL = "tiny random-weight Llama (grader)"

# A run ends when every request has, or after this many steps.
MAX_STEPS = 400
# Token ids below the tiny vocabulary's 320; the tiny model has no tokenizer.
VOCAB = 320


def ids(n: int, start: int) -> list[int]:
    """A token-id prompt of ``n`` ids, the same every run."""
    return [(start + 7 * i) % VOCAB for i in range(n)]


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@dataclass
class Scenario:
    """One chapter's run: the engine's settings, and what happens at which step."""

    title: str
    engine_args: dict[str, Any]
    # step -> what to do before that step (add, abort, stream more prompt).
    events: dict[int, Callable[[LLMEngine], None]] = field(default_factory=dict)
    real_model: bool = False  # SmolLM2 instead of the tiny random Llama


def _add(request_id: str, prompt: list[int], params: SamplingParams, streaming: bool = False) -> Callable[..., None]:
    return lambda engine: engine.add_request(request_id, {"prompt_token_ids": prompt}, params, streaming=streaming)


def _chat(request_id: str, text: str, params: SamplingParams) -> Callable[[LLMEngine], None]:
    def add(engine: LLMEngine) -> None:
        engine.add_rendered_request(request_id, engine.renderer.render_chat([{"role": "user", "content": text}]), params)

    return add


def _all(*actions: Callable[[LLMEngine], None]) -> Callable[[LLMEngine], None]:
    def run(engine: LLMEngine) -> None:
        for action in actions:
            action(engine)

    return run


SHARED = ids(48, start=11)
SCENARIOS: dict[str, Scenario] = {
    "ch03": Scenario(
        "Six requests, a 32-token budget, 9 KV blocks of 16 tokens",
        {"max_num_batched_tokens": 32, "num_gpu_blocks_override": 10},
        {0: _all(_add("0", ids(40, 3), greedy(12)), _add("1", ids(12, 5), greedy(16))),
         2: _add("2", ids(25, 7), greedy(16)),
         4: _all(_add("3", ids(30, 9), greedy(12)), _add("4", ids(8, 13), greedy(20))),
         6: _add("5", ids(50, 17), greedy(8))},
    ),
    "ch04": Scenario(
        "A 48-token prefix shared by three requests; prefix caching on; 12 KV blocks of 16 tokens",
        {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 13, "enable_prefix_caching": True},
        {0: _add("a", SHARED + ids(10, 40), greedy(10)),
         3: _add("b", SHARED + ids(20, 80), greedy(10)),
         5: _add("c", SHARED + ids(5, 120), greedy(10)),
         18: _add("d", ids(80, 160), greedy(8)),
         24: _add("e", SHARED + ids(3, 200), greedy(6))},
    ),
    "ch05": Scenario(
        "A request's states: streaming input, an abort, a stop token, a length cap",
        {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 32},
        {0: _all(_add("streamed", ids(10, 1), greedy(8), streaming=True), _add("aborted", ids(20, 2), greedy(50)),
                 _add("stopped", ids(15, 3), SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[141]))),
         1: _add("capped", ids(30, 4), greedy(6)),
         3: lambda engine: engine.append_prompt("streamed", ids(12, 5)),
         6: lambda engine: engine.abort_request("aborted"),
         8: lambda engine: engine.append_prompt("streamed", ids(6, 6), final=True)},
    ),
    "ch09": Scenario(
        "ngram speculation, k = 3, on prompts that repeat themselves",
        {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 32,
         "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                "prompt_lookup_max": 4}},
        {0: _chat("0", BY_HAND_PROMPT, greedy(32)), 2: _chat("1", BY_HAND_PROMPT.replace("exactly", "now"), greedy(24))},
        real_model=True,
    ),
}


# Chapter 10's two engines: blocks of 16, a shared prefix of 32 tokens in the second prompt.
PD_PROMPTS = {"p1": ids(45, 30), "p2": ids(32, 30) + ids(14, 210), "p3": ids(20, 90)}
PD_DEADLINE_S = 30.0
# The two traces record_disaggregated writes (one run, two engines), and every trace's name.
DISAGGREGATED = ("ch10-producer", "ch10-consumer")
TRACE_NAMES = [*SCENARIOS, *DISAGGREGATED]


def record_all(out_dir: Path, names: list[str] | None = None) -> list[Path]:
    """Every trace (or those ``names``), written into ``out_dir``."""
    chosen = names or TRACE_NAMES
    paths = [record(name, out_dir) for name in chosen if name in SCENARIOS]
    if any(name in DISAGGREGATED for name in chosen):
        paths += record_disaggregated(out_dir)
    return paths


def _engine(real_model: bool, **engine_args: Any) -> LLMEngine:
    """SmolLM2 (``real_model``) or the tiny random Llama, blocks of 16, float32."""
    args = {"block_size": 16, "max_model_len": 256 if real_model else 128, "dtype": "float32",
            "skip_tokenizer_init": not real_model, **engine_args}
    model = resolve_model_path(DEFAULT_MODEL) if real_model else tiny_llama_model_dir(2)
    return LLMEngine.from_engine_args(EngineArgs(model=model, **args))


def record_disaggregated(out_dir: Path) -> list[Path]:
    """Chapter 10: a producer and a consumer engine, stepped in turns as two servers would run.

    Each prompt is prefilled on the producer (``max_tokens`` 1 and
    ``do_remote_decode``, as the proxy sends it); its answer's
    ``kv_transfer_params`` go with the same prompt to the consumer, which
    pulls the blocks and decodes.
    """
    pool = {"num_gpu_blocks_override": 24, "enable_prefix_caching": True, "max_num_batched_tokens": 64}
    producer = _engine(False, **pool, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_producer",
                                                        "kv_port": get_open_port()})
    consumer = _engine(False, **pool, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_consumer",
                                                        "kv_connector_extra_config": {"transfer_timeout_s": 10}})
    waves = [["p1"], ["p2", "p3"]]  # p2 and p3 leave once p1 decodes, so p2 finds p1's blocks cached
    sent_on: set[str] = set()
    producer_core, consumer_core = producer.engine_core.get_engine_core(), consumer.engine_core.get_engine_core()
    try:
        with record_frames(producer_core) as sent, record_frames(consumer_core) as received:
            deadline = time.monotonic() + PD_DEADLINE_S
            while waves or consumer.has_unfinished_requests() or producer_core.scheduler.held_for_remote:
                if waves and _all_pulled(consumer_core, sent_on):
                    for name in waves.pop(0):
                        producer.add_request(name, {"prompt_token_ids": PD_PROMPTS[name]}, _remote(1, do_remote_decode=True))
                        sent_on.add(name)
                for output in producer.step():
                    if output.finished and output.kv_transfer_params:
                        consumer.add_request(output.request_id, {"prompt_token_ids": PD_PROMPTS[output.request_id]},
                                             _remote(12, **output.kv_transfer_params))
                consumer.step()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"chapter 10's run did not end within {PD_DEADLINE_S:.0f} s "
                                       "(a pull that never finished?)")
        titles = ("The prefill engine (kv_producer)", "The decode engine (kv_consumer)")
        return [save_trace(feed, out_dir / f"{name}.json", {"scenario": name, "title": title, "model": TINY_MODEL})
                for feed, name, title in zip((sent, received), DISAGGREGATED, titles)]
    finally:
        producer.shutdown()
        consumer.shutdown()


def _all_pulled(consumer_core: Any, names: set[str]) -> bool:
    """Whether every request in ``names`` reached the consumer and left WAITING_FOR_REMOTE_KVS."""
    requests = consumer_core.scheduler.requests
    return all(name in requests and requests[name].status != RequestStatus.WAITING_FOR_REMOTE_KVS for name in names)


def _remote(max_tokens: int, **kv_transfer_params: Any) -> SamplingParams:
    return greedy(max_tokens, extra_args={"kv_transfer_params": kv_transfer_params})


def record(name: str, out_dir: Path) -> Path:
    """Run scenario ``name`` on a fresh engine and write ``out_dir/<name>.json``."""
    scenario = SCENARIOS[name]
    engine = _engine(scenario.real_model, **scenario.engine_args)
    core = engine.engine_core.get_engine_core()
    try:
        with record_frames(core) as feed:
            for step in range(MAX_STEPS):
                if step in scenario.events:
                    scenario.events[step](engine)
                elif not engine.has_unfinished_requests() and step > max(scenario.events):
                    break
                engine.step()
        return save_trace(feed, out_dir / f"{name}.json",
                          {"scenario": name, "title": scenario.title,
                           "model": DEFAULT_MODEL if scenario.real_model else TINY_MODEL})
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description="Record the docs site's step traces.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"some of {', '.join(TRACE_NAMES)} (default: all)")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in TRACE_NAMES]
    if unknown:
        parser.error(f"no scenario {', '.join(unknown)}: choose from {', '.join(TRACE_NAMES)}")
    for path in record_all(args.out, args.names):
        print(path)


if __name__ == "__main__":
    main()
