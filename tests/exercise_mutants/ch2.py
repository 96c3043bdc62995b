"""Wrong answers to the chapter-2 exercise (see ``__init__.py``)."""

from __future__ import annotations

from exercise_mutants import Mutant, mutate

MUTANTS: list[Mutant] = [
    Mutant(
        "2.1",
        "reads Q8_0's integers as unsigned bytes",
        mutate("2.1", ("d * body.view(torch.int8).float()", "d * body.float()")),
        caught_by="Q8_0: each number is d times its byte, read as a signed integer",
    ),
    Mutant(
        "2.1",
        "interleaves the nibbles (byte 0's low and high nibbles as numbers 0 and 1)",
        mutate("2.1", ("torch.cat([body & 0x0F, body >> 4], dim=-1)",
                       "torch.stack([body & 0x0F, body >> 4], dim=-1).flatten(-2)")),
        caught_by="Q4_0: low nibbles are numbers 0-15, high nibbles 16-31, each d * (q - 8)",
    ),
    Mutant(
        "2.1",
        "forgets Q4_0's offset of 8",
        mutate("2.1", ("d * (q - 8) if", "d * q if")),
        caught_by="Q4_0: low nibbles are numbers 0-15, high nibbles 16-31, each d * (q - 8)",
    ),
    Mutant(
        "2.1",
        "takes Q4_1's minimum for its scale and the scale for its minimum",
        mutate("2.1", ("else d * q + _half(blocks[..., 2:4])", "else _half(blocks[..., 2:4]) * q + d")),
        caught_by="Q4_1: d * q + m, the scale first and the minimum after it",
    ),
    Mutant(
        "2.1",
        "subtracts Q4_1's minimum",
        mutate("2.1", ("else d * q + _half(blocks[..., 2:4])", "else d * q - _half(blocks[..., 2:4])")),
        caught_by="Q4_1: d * q + m, the scale first and the minimum after it",
    ),
]
