"""The grader's checks for exercise 1.1 (chapter 1).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from typing import Any

import chapters.ex01_engine_by_hand as ex01
from chapters.grade_checks.common import PROMPTS, SMALL_BLOCKS, Check
from nanoengine import LLM, SamplingParams
from nanoengine.renderers.hf import TokensPrompt


# ------------------------------------------------------------ 1.1 by hand
def by_hand_output(model: str) -> dict[str, Any]:
    llm = LLM(model=model, **SMALL_BLOCKS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    output = ex01.run_to_completion(llm.llm_engine, "by-hand", TokensPrompt(prompt_token_ids=PROMPTS[0]), params)
    assert output.finished and output.request_id == "by-hand"
    expected = llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], params, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == list(expected.outputs[0].token_ids), "differs from generate()"
    return {"request_id": output.request_id, "token_ids": list(output.outputs[0].token_ids),
            "finish_reason": output.outputs[0].finish_reason}


CHECKS: dict[str, tuple[Check, ...]] = {
    "1.1": (Check("returns the finished output, equal to generate()", by_hand_output),),
}
