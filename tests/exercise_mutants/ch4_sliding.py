"""Wrong answers to chapter 4's sliding-window exercise, 4.6 (see ``__init__.py``).

Each is caught first by the check named after the promise it breaks
(``chapters/grade_checks/ch4_sliding.py``).
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# Lines of the reference as they stand in its (dedented) source.
_NUM_SKIPPED = "num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size"
_WALK_BACK = "for index in range(min(num_skipped_blocks, len(blocks)) - 1, -1, -1):"
_STOP_AT_NULL = "        if blocks[index] is null_block:\n            break\n"
_SWAP = "blocks[index] = null_block"
_FREE = "self.block_pool.free_blocks(removed)"

MUTANTS: list[Mutant] = [
    Mutant(
        "4.6",
        "drops the skipped entries from the table instead of putting the null block there",
        mutate("4.6", (_SWAP, "pass"), (_FREE, f"{_FREE}\n    del blocks[: len(removed)]")),
        caught_by="the table keeps its length: the null block in place of each given-back block",
    ),
    Mutant(
        "4.6",
        "swaps in the null block but never gives the blocks to the pool",
        mutate("4.6", (_FREE, "pass")),
        caught_by="the given-back blocks go to the pool, the latest in the table first",
    ),
    Mutant(
        "4.6",
        "gives the blocks back from the first one on (block 0 is then evicted first)",
        mutate("4.6", (_FREE, "self.block_pool.free_blocks(reversed(removed))")),
        caught_by="the given-back blocks go to the pool, the latest in the table first",
    ),
    Mutant(
        "4.6",
        "rounds the skipped blocks up, giving back the block that holds the window's first key",
        mutate("4.6", (_NUM_SKIPPED, "num_skipped_blocks = -(-self.get_num_skipped_tokens(num_computed_tokens)"
                                     " // self.block_size)")),
        caught_by="keeps the block that holds the window's first key",
    ),
    Mutant(
        "4.6",
        "does not stop at the null block, so a second call gives the null block back",
        mutate("4.6", (_STOP_AT_NULL, "")),
        caught_by="a later call gives back only the newly skipped blocks; no blocks, no change",
    ),
    Mutant(
        "4.6",
        "reads the window itself instead of asking get_num_skipped_tokens (full attention has none)",
        mutate("4.6", (_NUM_SKIPPED, "num_skipped_blocks = max(num_computed_tokens - self.sliding_window + 1, 0)"
                                     " // self.block_size")),
        caught_by="full attention skips nothing: get_num_skipped_tokens decides",
    ),
    Mutant(
        "4.6",
        "walks every skipped index even past the table's end",
        mutate("4.6", (_WALK_BACK, "for index in range(num_skipped_blocks - 1, -1, -1):")),
        caught_by="a later call gives back only the newly skipped blocks; no blocks, no change",
    ),
]
