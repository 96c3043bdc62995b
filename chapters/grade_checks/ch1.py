"""The grader's checks for exercise 1.1 (chapter 1).

Each promise on the exercise page has a check of its own, named in a student's
words. The unit checks drive ``run_to_completion`` with ``ScriptedEngine``, a
stand-in for ``LLMEngine`` whose ``step()`` hands out outputs chosen in
advance, so cases a short real generation may not reach come one call away:
another request finishing first, a step with no output, an engine that runs
dry before the request finishes. The end-to-end check then does it all on a
real engine.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from typing import Any

import chapters.ex01_engine_by_hand as ex01
from chapters.grade_checks.common import SMALL_BUDGET, Check
from nanoengine import LLM, SamplingParams
from nanoengine.outputs import CompletionOutput, RequestOutput
from nanoengine.renderers.hf import TokensPrompt

PROMPT = TokensPrompt(prompt_token_ids=[5, 17, 33, 40])
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
# Past this many step() calls on an engine with nothing unfinished, the loop is taken to never end.
MAX_IDLE_STEPS = 100


class LoopNeverEnds(Exception):
    """Raised by ``ScriptedEngine`` instead of letting a loop spin forever."""


def output(request_id: str, token_ids: list[int], finished: bool) -> RequestOutput:
    """A ``RequestOutput`` as ``LLMEngine.step()`` returns it."""
    completion = CompletionOutput(index=0, text="", token_ids=token_ids, finish_reason="length" if finished else None)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[5, 17, 33, 40],
                         outputs=[completion], finished=finished)


class ScriptedEngine:
    """Stands in for ``LLMEngine``: ``step()`` returns the scripted lists of outputs in order,
    and ``has_unfinished_requests()`` is True while any are left. On an engine with nothing
    left, ``step()`` returns ``[]`` as the real one does, and raises ``LoopNeverEnds`` once a
    loop has clearly stopped asking.
    """

    def __init__(self, script: list[list[RequestOutput]]) -> None:
        self.script = list(script)
        self.added: list[str] = []
        self.idle_steps = 0

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self.added.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.script)

    def step(self) -> list[RequestOutput]:
        if self.script:
            return self.script.pop(0)
        self.idle_steps += 1
        if self.idle_steps > MAX_IDLE_STEPS:
            raise LoopNeverEnds(f"step() was called {self.idle_steps} times after has_unfinished_requests() "
                                "returned False: the loop never ends")
        return []


def describe(result: Any) -> str:
    """What ``run_to_completion`` returned, in one line a failure message can show."""
    if not isinstance(result, RequestOutput):
        return f"{result!r}, not a RequestOutput"
    return (f"the output of {result.request_id!r}, finished={result.finished}, "
            f"token_ids={list(result.outputs[0].token_ids)}")


def _run(engine: ScriptedEngine) -> str:
    return describe(ex01.run_to_completion(engine, "mine", PROMPT, PARAMS))  # type: ignore[arg-type]


# ------------------------------------------------------------ 1.1 by hand
def returns_finished_output(model: str) -> dict[str, Any]:
    """Request "mine" gets one token per step and finishes at its third step."""
    engine = ScriptedEngine([[output("mine", [7], False)], [output("mine", [7, 8], False)],
                             [output("mine", [7, 8, 9], True)]])
    return {"run_to_completion returned": _run(engine), "add_request calls, by request id": engine.added}


def skips_other_requests(model: str) -> dict[str, Any]:
    """Request "other", already in the engine, finishes in the first step, where "mine" makes
    progress too; in the second, "mine" finishes, listed before an output of request "late".
    """
    engine = ScriptedEngine([[output("other", [3], True), output("mine", [7], False)],
                             [output("mine", [7, 8], True), output("late", [4], False)]])
    return {"run_to_completion returned": _run(engine)}


def empty_step_is_not_the_end(model: str) -> dict[str, Any]:
    """Request "mine" is prefilled in two chunks: the first step returns no output at all
    (`[]`), while `has_unfinished_requests()` stays True; it finishes at the third step.
    """
    engine = ScriptedEngine([[], [output("mine", [7], False)], [output("mine", [7, 8], True)]])
    return {"run_to_completion returned": _run(engine)}


def never_loops_forever(model: str) -> dict[str, Any]:
    """An engine whose `has_unfinished_requests()` is False from the start (and stays False)."""
    engine = ScriptedEngine([])
    try:
        _run(engine)
    except NotImplementedError:  # a RuntimeError too, but the stub's: not an answer
        raise
    except RuntimeError:
        pass  # the page's answer; whether it is raised is the next check's business
    return {"run_to_completion ended on an engine with nothing unfinished": True}


def raises_when_dry(model: str) -> dict[str, Any]:
    """Request "mine" gets one token, then `has_unfinished_requests()` turns False before it finishes."""
    engine = ScriptedEngine([[output("mine", [7], False)]])
    try:
        returned = _run(engine)
    except NotImplementedError:
        raise
    except RuntimeError as error:
        return {"raised": "RuntimeError", "the message names 'mine'": "mine" in str(error)}
    return {"raised": f"nothing (returned {returned})", "the message names 'mine'": False}


class RecordingEngine:
    """A real ``LLMEngine`` whose ``step()`` results are recorded on the way through."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.steps: list[list[tuple[str, bool]]] = []

    def __getattr__(self, name: str) -> Any:  # any other method: the real engine's
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        self.engine.add_request(request_id, prompt, params)

    def has_unfinished_requests(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = self.engine.step()
        self.steps.append([(o.request_id, o.finished) for o in outputs])
        return outputs


def e2e_by_hand(model: str) -> dict[str, Any]:
    """A real engine with an 8-token step budget: "other" (3 tokens, 1 to generate) is added
    first; then "by-hand", a 20-token prompt (6 greedy tokens), whose second prefill chunk is
    a step with no output.
    """
    llm = LLM(model=model, **SMALL_BUDGET)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=list(range(10, 30)))
    try:
        llm.llm_engine.add_request("other", TokensPrompt(prompt_token_ids=[3, 4, 5]),
                                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        engine = RecordingEngine(llm.llm_engine)
        result = ex01.run_to_completion(engine, "by-hand", prompt, params)  # type: ignore[arg-type]
        generated = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    tokens = list(result.outputs[0].token_ids) if isinstance(result, RequestOutput) else None
    if isinstance(result, RequestOutput) and result.request_id == "by-hand" and result.finished:
        assert engine.steps[:2] == [[("other", True)], []], (  # a right answer: was the case the one meant?
            f"the run was meant to finish 'other' first, then step once with no output; steps: {engine.steps}"
        )
    return {"run_to_completion returned": describe(result),
            "its token_ids equal generate()'s for the same prompt": tokens == list(generated.outputs[0].token_ids)}


CHECKS: dict[str, tuple[Check, ...]] = {
    "1.1": (Check("returns your request's output once it is finished", returns_finished_output),
            Check("skips the outputs of other requests, even finished ones", skips_other_requests),
            Check("keeps stepping after a step with no output", empty_step_is_not_the_end),
            Check("never loops forever on an engine that has run dry", never_loops_forever),
            Check("raises RuntimeError naming the request id when the engine runs dry", raises_when_dry),
            Check("end to end: a real engine, another request finishing first", e2e_by_hand)),
}
