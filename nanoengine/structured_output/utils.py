"""Applying a grammar's token mask to the logits, in the worker.

Chapter 5 (structured output) builds the mask in the engine core; chapter 7's
``sample_tokens`` applies it here before sampling. Plain torch, so the worker
needs no grammar library. vLLM 0.32 counterpart: ``apply_grammar_bitmask`` in
``vllm/v1/structured_output/utils.py``.
"""

from __future__ import annotations

import torch

from nanoengine.core.sched.output import GrammarOutput


def apply_grammar_bitmask(
    logits: torch.Tensor, row_req_ids: list[str], grammar_output: GrammarOutput
) -> torch.Tensor:
    """Forbid tokens a request's grammar does not allow at this point.

    ``grammar_output.bitmask`` is packed as xgrammar (and vLLM) pack it: int32
    [num_structured_reqs, ceil(vocab / 32)], bit ``j`` of word ``w`` set when
    token ``32 * w + j`` is allowed; one row per id in
    ``structured_output_request_ids``. Unpacking in plain torch keeps the
    worker free of the grammar library.
    """
    packed = torch.as_tensor(grammar_output.bitmask, dtype=torch.int32, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # [rows, words, 32] -> [rows, words * 32]; "& 1" also undoes the sign
    # extension of the arithmetic shift on negative words.
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    row_of = {rid: row for row, rid in enumerate(row_req_ids)}
    for mask_row, req_id in enumerate(grammar_output.structured_output_request_ids):
        row = row_of.get(req_id)
        if row is not None:
            logits[row, : allowed.shape[1]].masked_fill_(~allowed[mask_row], float("-inf"))
    return logits
