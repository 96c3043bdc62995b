"""Wrong answers to chapter 4's hybrid-model exercises, 4.4 and 4.5 (see ``__init__.py``).

Each is caught first by the check named after the promise it breaks
(``chapters/grade_checks/ch4_hybrid.py``).
"""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

# Lines of the references as they stand in their (dedented) source.
# 4.4 asks each group's manager, pairing it with that group's hits:
_ASK_MANAGER = "manager.get_num_blocks_to_allocate(request_id, num_tokens, hit_blocks)"
_PAIRS = "zip(self.single_type_managers, new_computed_blocks, strict=True)"
# 4.5's answer once a state must fit:
_ROUNDED = "ATTENTION_BLOCK_ALIGNMENT * cdiv(state_bytes, bytes_per_step)"
_NO_STATE = "    if state_bytes == 0:\n        return requested\n"

MUTANTS: list[Mutant] = [
    # ------------------------------------- 4.4 get_num_blocks_to_allocate
    Mutant(
        "4.4",
        "counts the attention group only, forgetting the state groups",
        mutate("4.4", (_PAIRS, "zip(self.single_type_managers[:1], new_computed_blocks[:1], strict=True)")),
        caught_by="a new request: attention blocks plus one block per state group, whatever its length",
    ),
    Mutant(
        "4.4",
        "takes the neediest group's count (max) instead of the sum over the one pool",
        mutate("4.4", ("return sum(", "return max(")),
        caught_by="a new request: attention blocks plus one block per state group, whatever its length",
    ),
    Mutant(
        "4.4",
        "sizes every group's blocks in attention tokens (a state group grows with the request)",
        mutate("4.4", (_ASK_MANAGER, ("max(-(-num_tokens // self.kv_cache_config.block_size)"
                                      " - len(manager.get_blocks(request_id)) - len(hit_blocks), 0)"))),
        caught_by="a new request: attention blocks plus one block per state group, whatever its length",
    ),
    Mutant(
        "4.4",
        "counts each state group's block again at every step",
        mutate("4.4", (_ASK_MANAGER, f"(1 if manager.block_size >= self.max_model_len else {_ASK_MANAGER})")),
        caught_by="a running request: no more state blocks, one attention block per block_size tokens",
    ),
    Mutant(
        "4.4",
        "counts every block the request needs, not the ones it lacks (what it holds counted again)",
        mutate("4.4", (_ASK_MANAGER, "manager.kv_cache_spec.num_blocks_for(num_tokens)")),
        caught_by="a running request: no more state blocks, one attention block per block_size tokens",
    ),
    Mutant(
        "4.4",
        "ignores the cache hits (passes none to the managers)",
        mutate("4.4", (_ASK_MANAGER, "manager.get_num_blocks_to_allocate(request_id, num_tokens, [])")),
        caught_by="cache hits: an evictable hit (ref_cnt 0) takes a free block, a held hit none",
    ),
    Mutant(
        "4.4",
        "subtracts the hits but does not count an evictable hit as a block taken from the pool",
        mutate("4.4", (_ASK_MANAGER, ("max(manager.kv_cache_spec.num_blocks_for(num_tokens)"
                                      " - len(manager.get_blocks(request_id)) - len(hit_blocks), 0)"))),
        caught_by="cache hits: an evictable hit (ref_cnt 0) takes a free block, a held hit none",
    ),
    # --------------------------------------------- 4.5 align_hybrid_block_size
    Mutant(
        "4.5",
        "raises a plain model's block size to 16 too (at least one step, state or not)",
        mutate("4.5", (_NO_STATE, ""),
               (_ROUNDED, "ATTENTION_BLOCK_ALIGNMENT * max(cdiv(state_bytes, bytes_per_step), 1)")),
        caught_by="no state: the requested block size is kept",
    ),
    Mutant(
        "4.5",
        "adds steps while K and V take at most the state (<= where < belongs)",
        mutate("4.5", (f"return max(requested, {_ROUNDED})",
                       ("block_size = ATTENTION_BLOCK_ALIGNMENT\n"
                        "    while block_size * attention_bytes_per_token <= state_bytes:\n"
                        "        block_size += ATTENTION_BLOCK_ALIGNMENT\n"
                        "    return max(requested, block_size)"))),
        caught_by="exact fit: K and V of the block take exactly the state's bytes",
    ),
    Mutant(
        "4.5",
        "rounds the number of steps down (floor, not ceil)",
        mutate("4.5", ("cdiv(state_bytes, bytes_per_step)", "(state_bytes // bytes_per_step)")),
        caught_by="rounds up: a state a byte short of 16 tokens' K and V takes those 16 tokens",
    ),
    Mutant(
        "4.5",
        "forgets the alignment: the fewest tokens whose K and V hold the state",
        mutate("4.5", (_ROUNDED, "cdiv(state_bytes, attention_bytes_per_token)")),
        caught_by="one byte over takes 16 more tokens: always a multiple of 16, even if fewer would do",
    ),
    Mutant(
        "4.5",
        "ignores the requested block size once there is a state",
        mutate("4.5", (f"max(requested, {_ROUNDED})", _ROUNDED)),
        caught_by="a larger requested block size is kept as it is",
    ),
    Mutant(
        "4.5",
        "rounds a larger requested block size up to a multiple of 16",
        mutate("4.5", (f"max(requested, {_ROUNDED})",
                       (f"ATTENTION_BLOCK_ALIGNMENT * cdiv(max(requested, {_ROUNDED}),"
                        " ATTENTION_BLOCK_ALIGNMENT)"))),
        caught_by="a larger requested block size is kept as it is",
    ),
]
