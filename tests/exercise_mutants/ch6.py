"""Wrong answers to the chapter-6 exercises (see ``__init__.py``)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = [
    Mutant(
        "6.1",
        "sizes a block for one layer only",
        mutate("6.1", ("available_bytes // spec.page_size_bytes",
                       "available_bytes // (spec.page_size_bytes // spec.num_layers)")),
        caught_by="blocks from a byte budget: one block is spec.page_size_bytes (K and V, every layer)",
    ),
    Mutant(
        "6.1",
        "sizes a block for K only, forgetting V",
        mutate("6.1", ("available_bytes // spec.page_size_bytes",
                       ("available_bytes // (spec.block_size * spec.num_kv_heads * spec.head_dim"
                        " * spec.dtype_size * spec.num_layers)"))),
        caught_by="blocks from a byte budget: one block is spec.page_size_bytes (K and V, every layer)",
    ),
    Mutant(
        "6.1",
        "counts tokens, not blocks (divides by the bytes of one token)",
        mutate("6.1", ("available_bytes // spec.page_size_bytes",
                       "available_bytes // (spec.page_size_bytes // spec.block_size)")),
        caught_by="blocks from a byte budget: one block is spec.page_size_bytes (K and V, every layer)",
    ),
    Mutant(
        "6.1",
        "rounds a partial block up (ceil)",
        mutate("6.1", ("available_bytes // spec.page_size_bytes", "-(-available_bytes // spec.page_size_bytes)")),
        caught_by="a partial block does not count (floor, not ceil)",
    ),
    Mutant(
        "6.1",
        "rounds to the nearest block",
        mutate("6.1", ("available_bytes // spec.page_size_bytes", "round(available_bytes / spec.page_size_bytes)")),
        caught_by="a partial block does not count (floor, not ceil)",
    ),
    Mutant(
        "6.1",
        "lets a negative budget give a negative count",
        mutate("6.1", ("max(available_bytes // spec.page_size_bytes, 0)", "available_bytes // spec.page_size_bytes")),
        caught_by="a zero or negative budget fits no block (0, not negative)",
    ),
]
