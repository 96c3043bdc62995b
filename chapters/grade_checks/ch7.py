"""The grader's checks for exercise 7.1 (chapter 7).

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

import random

import torch

from chapters.grade_checks.common import Check, e2e_plain
from nanoengine.worker.input_batch import compute_slot_mapping


# --------------------------------------------------- 7.1 compute_slot_mapping
def slot_mappings(model: str) -> list[list[int]]:
    rng = random.Random(0)
    results = []
    for block_size in (1, 4, 16):
        num_reqs, width = 3, 5
        ids = rng.sample(range(1, 64), num_reqs * width)
        table = torch.tensor(ids, dtype=torch.int32).reshape(num_reqs, width)
        req_indices = torch.tensor([rng.randrange(num_reqs) for _ in range(20)])
        positions = torch.tensor([rng.randrange(width * block_size) for _ in range(20)])
        slots = compute_slot_mapping(table, req_indices, positions, block_size)
        assert slots.dtype == torch.int64 and slots.shape == (20,)
        results.append(slots.tolist())
    return results


CHECKS: dict[str, tuple[Check, ...]] = {
    "7.1": (Check("slots of random block tables", slot_mappings),
            Check("end to end: several requests, 4-token blocks", e2e_plain)),
}
