"""Wrong answers to chapter 6's tensor-parallel exercise, 6.2 (see ``__init__.py``).

Each is caught first by the check named after the promise it breaks
(``chapters/grade_checks/ch6_tensor_parallel.py``).
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# Lines of the reference as they stand in its (dedented) source.
_FIRST_KV_HEAD = "first_kv_head_of_rank(self.total_num_kv_heads, self.tp_size, self.tp_rank)"
_KV_OFFSET = "self.q_size + (self.kv_size if shard_id == \"v\" else 0)"
_WHOLE_SHAPE = "(total_heads * self.head_size, *param.shape[1:])"
# A whole line, indentation included, so that removing it leaves the code as it stood.
_CHECK = f"    check_shape(loaded_weight, {_WHOLE_SHAPE}, f\"The shard {{shard_id!r}}\")\n"
_COPY = "copy_weight(param.data.narrow(0, offset, rows), mine, f\"shard {shard_id!r}\")"

SPLIT_KV = "k and v split like q when there are at least as many KV heads as ranks"
REPLICATED_KV = "fewer KV heads than ranks: rank r takes KV head r * total_num_kv_heads // tp_size"
OFFSETS = "[q | k | v]: q at row 0, k after this rank's q rows, v after its k rows, nothing else written"
Q_SPLIT = "q: rank r takes query heads [r * num_heads, (r + 1) * num_heads), whole rows"
WRONG_SHAPE = "a tensor of the wrong shape: ValueError naming both shapes, nothing copied"

MUTANTS: list[Mutant] = [
    Mutant(
        "6.2",
        "splits q by rank but gives every rank the first KV heads (k and v not split)",
        mutate("6.2", (_FIRST_KV_HEAD, "0")),
        caught_by=SPLIT_KV,
    ),
    Mutant(
        "6.2",
        "splits k and v like q even when there are fewer KV heads than ranks (rank r takes head r)",
        mutate("6.2", (_FIRST_KV_HEAD, "self.tp_rank * self.num_kv_heads")),
        caught_by=REPLICATED_KV,
    ),
    Mutant(
        "6.2",
        "replicated KV heads dealt round-robin: rank r takes head r % total_num_kv_heads",
        mutate("6.2", (_FIRST_KV_HEAD, (f"(self.tp_rank % self.total_num_kv_heads"
                                        f" if self.tp_size > self.total_num_kv_heads else {_FIRST_KV_HEAD})"))),
        caught_by=REPLICATED_KV,
    ),
    Mutant(
        "6.2",
        "puts v right after q, over k",
        mutate("6.2", (_KV_OFFSET, "self.q_size")),
        caught_by=OFFSETS,
    ),
    Mutant(
        "6.2",
        "computes v's offset with q's size (q_size + q_size, past the fused weight)",
        mutate("6.2", (_KV_OFFSET, "self.q_size + (self.q_size if shard_id == \"v\" else 0)")),
        caught_by=OFFSETS,
    ),
    Mutant(
        "6.2",
        "takes its slice along the hidden dimension (columns), not along the rows",
        mutate("6.2", ("loaded_weight.narrow(0, first_head", "loaded_weight.narrow(-1, first_head")),
        caught_by=Q_SPLIT,
    ),
    Mutant(
        "6.2",
        "expects this rank's slice from the checkpoint instead of the whole projection",
        mutate("6.2", (_WHOLE_SHAPE, "(rows, *param.shape[1:])")),
        caught_by=Q_SPLIT,
    ),
    Mutant(
        "6.2",
        "leaves the bias alone (loads weights only)",
        mutate("6.2", ("if shard_id == \"q\":", "if param is self.bias:\n        return\n    if shard_id == \"q\":")),
        caught_by="the bias is split and placed like the weight",
    ),
    Mutant(
        "6.2",
        "never checks the shape: a wrong tensor is sliced and copied anyway",
        mutate("6.2", (_CHECK, "")),
        caught_by=WRONG_SHAPE,
    ),
    Mutant(
        "6.2",
        "checks the shape only after copying (a refused tensor is already written)",
        mutate("6.2", (_CHECK, ""), (_COPY, f"{_COPY}\n{_CHECK}")),
        caught_by=WRONG_SHAPE,
    ),
    Mutant(
        "6.2",
        "refuses a wrong shape with a message that names only the expected one",
        mutate("6.2", (_CHECK, (f"    if tuple(loaded_weight.shape) != {_WHOLE_SHAPE}:\n"
                                f"        raise ValueError(f\"The shard {{shard_id!r}} must have shape {{{_WHOLE_SHAPE}}}.\")\n"))),
        caught_by=WRONG_SHAPE,
    ),
    Mutant(
        "6.2",
        "loads any shard id other than q as k",
        mutate("6.2", ("elif shard_id in (\"k\", \"v\"):", "elif shard_id is not None:")),
        caught_by="an unknown shard id: ValueError, nothing copied",
    ),
]
