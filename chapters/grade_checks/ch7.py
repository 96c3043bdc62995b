"""The grader's checks for exercise 7.1 (chapter 7).

Each promise on the exercise page has a check of its own, named in a
student's words. The unit checks call ``compute_slot_mapping`` directly, with
block tables built as the model runner builds them (``int32``) and token
indices and positions as ``int64``, and return labeled tables: each key names
the inputs, each value is what came back. The end-to-end run comes last.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from chapters.grade_checks.common import Check, e2e_plain
from nanoengine.worker.input_batch import compute_slot_mapping


def slots(table: list[list[int]], req_indices: list[int], positions: list[int], block_size: int) -> torch.Tensor:
    """``compute_slot_mapping`` on plain lists, as ``prepare_inputs`` would pass them."""
    return compute_slot_mapping(torch.tensor(table, dtype=torch.int32), torch.tensor(req_indices, dtype=torch.int64),
                                torch.tensor(positions, dtype=torch.int64), block_size)


def as_list(result: Any) -> Any:
    return result.tolist() if isinstance(result, torch.Tensor) else f"{result!r}, not a tensor"


# --------------------------------------------------- 7.1 compute_slot_mapping
def dtype_and_shape(model: str) -> dict[str, Any]:
    """Two requests with block tables `[[3, 8], [5, 1]]` (`int32`), 4-token blocks: 6 tokens, then 1."""
    table: dict[str, Any] = {}
    for req_indices, positions in (([0, 0, 0, 0, 0, 1], [0, 1, 2, 3, 4, 2]), ([1], [5])):
        result = slots([[3, 8], [5, 1]], req_indices, positions, 4)
        label = f"{len(positions)} token{'s' * (len(positions) > 1)}"
        table[f"{label}: dtype"] = str(result.dtype) if isinstance(result, torch.Tensor) else repr(result)
        table[f"{label}: shape"] = list(result.shape) if isinstance(result, torch.Tensor) else None
    return table


def slot_formula(model: str) -> dict[str, Any]:
    """One request with block table `[[7, 3, 12]]`, positions 0 to 11, for 4-token blocks; and
    with `[[7, 3, 12, 2, 9, 4, 11, 6, 10, 5, 8, 1]]`, positions 0 to 11, for 1-token blocks.
    """
    table = {"block_size=4, block table [[7, 3, 12]], positions 0..11":
             as_list(slots([[7, 3, 12]], [0] * 12, list(range(12)), 4))}
    ids = [7, 3, 12, 2, 9, 4, 11, 6, 10, 5, 8, 1]
    table[f"block_size=1, block table [{ids}], positions 0..11"] = as_list(slots([ids], [0] * 12, list(range(12)), 1))
    return table


def own_row(model: str) -> dict[str, Any]:
    """Three requests with block tables `[[4, 9], [6, 2], [11, 13]]`, 2-token blocks; their
    tokens interleaved: request 2 at positions 3 and 0, request 0 at 1, request 1 at 2 and 0.
    """
    req_indices, positions = [2, 0, 1, 2, 1], [3, 1, 2, 0, 0]
    label = f"block_size=2, block table [[4, 9], [6, 2], [11, 13]], req_indices {req_indices}, positions {positions}"
    return {label: as_list(slots([[4, 9], [6, 2], [11, 13]], req_indices, positions, 2))}


def random_tables(model: str) -> dict[str, Any]:
    """Random tables of 3 requests x 4 distinct block ids (1-63), 10 tokens at random rows and
    positions, for block sizes 1, 4 and 16 (seeded: the same every run).
    """
    rng = random.Random(0)
    table: dict[str, Any] = {}
    for block_size in (1, 4, 16):
        num_reqs, width = 3, 4
        ids = rng.sample(range(1, 64), num_reqs * width)
        rows = [ids[r * width:(r + 1) * width] for r in range(num_reqs)]
        req_indices = [rng.randrange(num_reqs) for _ in range(10)]
        positions = [rng.randrange(width * block_size) for _ in range(10)]
        table[f"block_size={block_size}, block table {rows}, req_indices {req_indices}, positions {positions}"] = (
            as_list(slots(rows, req_indices, positions, block_size)))
    return table


def no_int32_overflow(model: str) -> dict[str, Any]:
    """A block table (`int32`) holding block id `2**27 + 5`, 16-token blocks: the slots lie past
    `2**31 - 1`, the largest `int32`.
    """
    block_id = 2**27 + 5
    assert block_id * 16 > torch.iinfo(torch.int32).max, "the slots were meant to overflow int32"
    return {f"block_size=16, block table [[{block_id}]], positions 0, 7, 15":
            as_list(slots([[block_id]], [0, 0, 0], [0, 7, 15], 16))}


CHECKS: dict[str, tuple[Check, ...]] = {
    "7.1": (Check("returns int64 of shape [num_tokens]", dtype_and_shape),
            Check("slot = block_id * block_size + position % block_size", slot_formula),
            Check("each token reads its own request's row of the block table", own_row),
            Check("slots of random block tables", random_tables),
            Check("no int32 overflow: slots past the largest int32", no_int32_overflow),
            Check("end to end: several requests, 4-token blocks", e2e_plain)),
}
