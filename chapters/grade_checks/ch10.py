"""The grader's checks for exercise 10.1 (chapter 10): the decode engine plans its pull.

Each promise on the exercise page has a check of its own, named in a
student's words. The unit checks call ``update_state_after_alloc`` on a
consumer's ``ZmqConnectorScheduler`` (blocks of 4 tokens) as the scheduler
does, then read what it planned the way the scheduler does too: the
``reqs_to_recv`` of the next ``build_connector_meta``. The request's own
blocks are numbered 7, 3, 9, 4, 8 and the producer's 100, 101, ..., so every
label shows which block goes where. The end-to-end run moves real KV from a
producer engine to a consumer engine over loopback TCP, once with nothing
in the consumer's prefix cache and once with part of the prompt there, on
the grader's tiny Llama (the blocks' bytes, not the words, are the point,
and three tiny engines start in a second where three SmolLM2s take many).
A consumer request that never leaves ``WAITING_FOR_REMOTE_KVS`` (no pull
was planned for it) is reported by that state, not as a hang.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import time
from typing import Any

from chapters.grade_checks.common import SMALL_BLOCKS, Check, make_request
from chapters.grade_checks.tiny_model import tiny_llama_model_dir
from nanoengine.config import KVTransferConfig
from nanoengine.distributed.kv_transfer.zmq.metadata import PullPlan
from nanoengine.distributed.kv_transfer.zmq.scheduler import ZmqConnectorScheduler
from nanoengine.engine.arg_utils import EngineArgs
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.outputs import RequestOutput
from nanoengine.renderers.hf import TokensPrompt
from nanoengine.request import Request, RequestStatus
from nanoengine.sampling_params import SamplingParams
from nanoengine.utils.system_utils import get_open_port

BLOCK = 4
# The consumer's blocks for a request, in order, and the producer's for the same prompt.
LOCAL_BLOCKS = [7, 3, 9, 4, 8]
REMOTE_BLOCKS = [100, 101, 102, 103, 104]
PRODUCER = {"remote_engine_id": "producer-engine", "remote_request_id": "prefill-7",
            "remote_host": "127.0.0.1", "remote_port": 14579}


def consumer_connector() -> ZmqConnectorScheduler:
    config = KVTransferConfig(kv_connector="ZmqConnector", kv_role="kv_consumer")
    return ZmqConnectorScheduler(config, block_size=BLOCK, tensor_parallel_size=1)


def remote_request(num_prompt_tokens: int, params: dict[str, Any] | None = None) -> Request:
    """A consumer's request of ``num_prompt_tokens`` as the proxy sends it (or with ``params``)."""
    request = make_request("decode-1", num_prompt_tokens)
    request.kv_transfer_params = dict(params) if params is not None else {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(REMOTE_BLOCKS),
        "tp_size": 1, **PRODUCER}
    return request


def planned(connector: ZmqConnectorScheduler) -> list[PullPlan]:
    """The pulls the next step hands the worker, read as the scheduler reads them."""
    metadata = connector.build_connector_meta({}, {}, lambda request_id: ())
    return list(metadata.reqs_to_recv)


def pull(num_prompt_tokens: int, num_computed_tokens: int, num_external_tokens: int) -> Any:
    """Call the function on a fresh request and connector; what it planned, in words."""
    connector = consumer_connector()
    request = remote_request(num_prompt_tokens)
    num_blocks = -(-num_prompt_tokens // BLOCK)
    connector.update_state_after_alloc(request, (LOCAL_BLOCKS[:num_blocks],), num_computed_tokens,
                                       num_external_tokens)
    plans = planned(connector)
    if len(plans) != 1:
        return f"{len(plans)} plans"
    return {"local blocks": plans[0].local_block_ids, "remote blocks": plans[0].remote_block_ids}


def _label(num_prompt_tokens: int, num_computed_tokens: int, num_external_tokens: int) -> str:
    return (f"{num_prompt_tokens}-token prompt, {num_computed_tokens} tokens of local hits, "
            f"{num_external_tokens} remote tokens")


def _pulls(*cases: tuple[int, int, int]) -> dict[str, Any]:
    return {_label(*case): pull(*case) for case in cases}


def no_local_hits(model: str) -> dict[str, Any]:
    """Nothing in the consumer's prefix cache: a 13-token prompt offered 12 remote tokens
    (blocks 0-2 hold them, block 3 only the last prompt token), and a 9-token one offered 8."""
    return _pulls((13, 0, 12), (9, 0, 8))


def local_hits_stay_home(model: str) -> dict[str, Any]:
    """The first 2 or 3 blocks were prefix-cache hits: a 17-token prompt with 8 tokens of hits
    offered 8, and one with 12 tokens of hits offered 4."""
    return _pulls((17, 8, 8), (17, 12, 4))


def partial_last_block(model: str) -> dict[str, Any]:
    """The remote tokens end inside a block: an 11-token prompt offered 10 (block 2 holds 2 of
    them), one with 4 tokens of hits offered 10, and a 6-token prompt offered 5."""
    return _pulls((11, 0, 10), (15, 4, 10), (6, 0, 5))


def nothing_to_pull(model: str) -> dict[str, Any]:
    """Offered 0 remote tokens (every prompt block but the last was a hit), called as the
    scheduler calls it then: no block ids, 0 external tokens."""
    connector = consumer_connector()
    request = remote_request(9)
    connector.update_state_after_alloc(request, (), 8, 0)
    plans = planned(connector)
    return {"plans": len(plans),
            "blocks of the plan (local, remote)": [(p.local_block_ids, p.remote_block_ids) for p in plans]}


def once_only(model: str) -> dict[str, Any]:
    """A 13-token prompt offered 12 remote tokens, the function called twice (as a second
    admission would); the plans after each call and ``do_remote_prefill`` after the first."""
    connector = consumer_connector()
    request = remote_request(13)
    block_ids = (LOCAL_BLOCKS[:4],)
    connector.update_state_after_alloc(request, block_ids, 0, 12)
    first = len(planned(connector))
    flag = (request.kv_transfer_params or {}).get("do_remote_prefill")
    connector.update_state_after_alloc(request, block_ids, 0, 12)
    return {"plans after the first call": first, "do_remote_prefill after the first call": flag,
            "plans after the second call": len(planned(connector))}


def leaves_others_alone(model: str) -> dict[str, Any]:
    """Requests that are not to be pulled: no kv_transfer_params, a prefill-side request
    (``do_remote_decode``) and ``do_remote_prefill: false``; the plans, and the params after."""
    table: dict[str, Any] = {}
    for label, params in (("no kv_transfer_params", {}), ("do_remote_decode: true", {"do_remote_decode": True}),
                          ("do_remote_prefill: false", {"do_remote_prefill": False, **PRODUCER})):
        connector = consumer_connector()
        request = remote_request(13, params)
        if not params:  # what a request without the field carries
            request.kv_transfer_params = None
        connector.update_state_after_alloc(request, (LOCAL_BLOCKS[:4],), 0, 12)
        table[label] = {"plans": len(planned(connector)), "kv_transfer_params after": request.kv_transfer_params}
    return table


def names_the_producer(model: str) -> dict[str, Any]:
    """A 13-token prompt offered 12 remote tokens: whose blocks the plan reads, and where."""
    connector = consumer_connector()
    request = remote_request(13)
    connector.update_state_after_alloc(request, (LOCAL_BLOCKS[:4],), 0, 12)
    plans = planned(connector)
    if len(plans) != 1:
        return {"plans": len(plans)}
    plan = plans[0]
    return {"this engine's request id": plan.request_id, "the producer's request id": plan.remote_request_id,
            "the producer's engine id": plan.remote_engine_id,
            "the producer's host and port": f"{plan.remote_host}:{plan.remote_port}"}


# ------------------------------------------------------------------ end to end
# 30 tokens: 7 full blocks and 2 tokens. The second prompt shares the first 16.
E2E_PROMPTS = [[3 + (7 * i) % 200 for i in range(30)], [3 + (7 * i) % 200 for i in range(16)] + list(range(60, 74))]
E2E_TOKENS = 8
# How long the run may step the engines before it says the request never finished.
E2E_DEADLINE_S = 60.0
# A pull of a few blocks over loopback takes milliseconds; a consumer request
# still waiting for its KV after this long will not get it.
STUCK_WAITING_S = 10.0


def _engine(model: str, **kwargs: Any) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model, enable_prefix_caching=True, skip_tokenizer_init=True,
                                                 **SMALL_BLOCKS, **kwargs))


def _finish(engine: LLMEngine, request_id: str, other: LLMEngine | None = None) -> RequestOutput:
    """Step ``engine`` (and ``other``, which registers and frees its held blocks) until ``request_id`` ends;
    a request stuck waiting for its KV is reported by its state."""
    start = time.monotonic()
    while (waited := time.monotonic() - start) < E2E_DEADLINE_S:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
        if other is not None:
            other.step()
        status = _status_of(engine, request_id)
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS and waited > STUCK_WAITING_S:
            raise RuntimeError(f"request {request_id} is still in {status.name} after {waited:.0f} s: its KV never "
                               "arrived, so no pull was planned for it (or it pulled from the wrong place)")
    raise RuntimeError(f"request {request_id} did not finish within {E2E_DEADLINE_S:g} s "
                       f"(it is {_status_of(engine, request_id)})")


def _status_of(engine: LLMEngine, request_id: str) -> RequestStatus | None:
    """The request's state in ``engine``'s scheduler (None once it has left)."""
    request = engine.engine_core.get_engine_core().scheduler.requests.get(request_id)
    return None if request is None else request.status


def _greedy(max_tokens: int, **kv_transfer_params: Any) -> SamplingParams:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


def e2e_two_engines(model: str) -> dict[str, Any]:
    """A producer engine and a consumer engine in one process on the grader's tiny Llama, blocks
    of 4 tokens, fp32: two 30-token prompts (the second shares 16 tokens with the first)
    prefilled on the producer, decoded for 8 tokens on the consumer; the tokens, the tokens
    pulled, and one engine's tokens."""
    model = tiny_llama_model_dir(2)
    plain = _engine(model)
    producer = _engine(model, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_producer",
                                                  "kv_port": get_open_port()})
    consumer = _engine(model, kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_consumer",
                                                  "kv_connector_extra_config": {"transfer_timeout_s": 10}})
    table: dict[str, Any] = {}
    try:
        for number, prompt in enumerate(E2E_PROMPTS, 1):
            plain.add_request(f"plain-{number}", TokensPrompt(prompt_token_ids=prompt), _greedy(E2E_TOKENS))
            alone = _finish(plain, f"plain-{number}")
            producer.add_request(f"prefill-{number}", TokensPrompt(prompt_token_ids=prompt),
                                 _greedy(1, do_remote_decode=True))
            params = _finish(producer, f"prefill-{number}").kv_transfer_params
            consumer.add_request(f"decode-{number}", TokensPrompt(prompt_token_ids=prompt),
                                 _greedy(E2E_TOKENS, **(params or {})))
            decoded = _finish(consumer, f"decode-{number}", other=producer)
            table[f"prompt {number}: tokens"] = list(decoded.outputs[0].token_ids)
            table[f"prompt {number}: tokens pulled from the producer"] = decoded.num_external_computed_tokens
            table[f"prompt {number}: the same tokens as one engine alone"] = (
                list(decoded.outputs[0].token_ids) == list(alone.outputs[0].token_ids))
    finally:
        for engine in (plain, producer, consumer):
            engine.shutdown()
    return table


CHECKS: dict[str, tuple[Check, ...]] = {
    "10.1": (Check("no local hits: every block the remote tokens fill is pulled", no_local_hits),
             Check("local prefix-cache hits stay home: only the blocks after them are pulled",
                   local_hits_stay_home),
             Check("a block the remote tokens fill only in part is pulled too (round up)", partial_last_block),
             Check("nothing to pull: one plan with no blocks, so the producer frees them", nothing_to_pull),
             Check("a request that is not to be pulled is left alone", leaves_others_alone),
             Check("once only: do_remote_prefill is cleared, a second call plans nothing", once_only),
             Check("the plan names the producer's request, engine, host and port", names_the_producer),
             Check("end to end: KV from a producer engine gives a consumer one engine's tokens", e2e_two_engines,
                   own_model="the grader's tiny Llama")),
}
