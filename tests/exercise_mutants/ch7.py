"""Wrong answers to the chapter-7 exercises (see ``__init__.py``)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# The reference's one lookup, which most mistakes change.
LOOKUP = "block_table[req_indices, positions // block_size]"

MUTANTS: list[Mutant] = [
    Mutant(
        "7.1",
        "returns the block table's int32",
        mutate("7.1", ("return block_ids * block_size + positions % block_size",
                       "return (block_ids * block_size + positions % block_size).to(block_table.dtype)")),
        caught_by="returns int64 of shape [num_tokens]",
    ),
    Mutant(
        "7.1",
        "looks up block_table[req_indices][:, logical block]: a [num_tokens, num_tokens] table",
        mutate("7.1", (LOOKUP, "block_table[req_indices][:, positions // block_size]")),
        caught_by="returns int64 of shape [num_tokens]",
    ),
    Mutant(
        "7.1",
        "adds the whole position instead of the offset in the block",
        mutate("7.1", ("+ positions % block_size", "+ positions")),
        caught_by="slot = block_id * block_size + position % block_size",
    ),
    Mutant(
        "7.1",
        "uses the logical block as the block id (no block table lookup)",
        mutate("7.1", (LOOKUP, "(positions // block_size)")),
        caught_by="slot = block_id * block_size + position % block_size",
    ),
    Mutant(
        "7.1",
        "reads the first request's row for every token",
        mutate("7.1", (LOOKUP, "block_table[0, positions // block_size]")),
        caught_by="each token reads its own request's row of the block table",
    ),
    Mutant(
        "7.1",
        "multiplies the int32 block ids before widening them to int64",
        mutate("7.1", (".to(torch.int64)", "")),
        caught_by="no int32 overflow: slots past the largest int32",
    ),
]
