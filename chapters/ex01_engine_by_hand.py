"""Chapter 1 -- drive the engine by hand: one ``add_request``, then ``step()`` until done.

``LLM.generate`` hides a loop: add every request, then call ``LLMEngine.step()``
until nothing is unfinished, keeping each request's final ``RequestOutput``.
Writing that loop for one request (exercise 1.1) shows what one step returns:
an output for every request that made progress, ``finished=True`` on the last.

    python -m chapters.ex01_engine_by_hand [--model DIR] [--max-tokens N]

vLLM 0.32 counterpart: ``LLM._run_engine`` in ``vllm/entrypoints/llm.py`` (the loop
this replaces by hand) over ``vllm/v1/engine/llm_engine.py`` (``add_request``, ``step``).
"""

from __future__ import annotations

from chapters._common import base_parser, console
from nanoengine import LLM, RequestOutput, SamplingParams
from nanoengine.engine.llm_engine import LLMEngine
from nanoengine.renderers.hf import PromptType


def run_to_completion(
    engine: LLMEngine, request_id: str, prompt: PromptType, params: SamplingParams
) -> RequestOutput:
    """Add one request to ``engine`` and step it by hand until that request finishes.

    Use ``engine.add_request(request_id, prompt, params)`` once, then call
    ``engine.step()`` repeatedly: each call returns the ``RequestOutput`` of every
    request that made progress in that step. Return the output of *this* request
    whose ``finished`` is True. If the engine runs dry before that happens, raise
    ``RuntimeError`` naming the request id (it must never loop forever).
    """
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
    raise RuntimeError(f"The engine ran out of work before request {request_id!r} finished.")


def main(argv: list[str] | None = None) -> None:
    args = base_parser(__doc__ or "", __name__).parse_args(argv)
    llm = LLM(model=args.model)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    output = run_to_completion(llm.llm_engine, "by-hand-0", "What is the capital of France?", params)
    completion = output.outputs[0]
    console.rule("run_to_completion: add_request once, step() until finished")
    console.print(f"{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}")
    console.print(repr(completion.text))


if __name__ == "__main__":
    main()
