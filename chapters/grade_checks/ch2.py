"""The grader's checks for exercise 2.1 (chapter 2): ``dequantize`` of GGML's block formats.

The unit checks hand ``dequantize`` blocks built byte by byte, one format at a
time (so a mistake in one format is named by that format's check), then whole
matrices quantized by the ``gguf`` package's numpy port of ggml. Each returns
the numbers that came back, labeled with the block that went in. The
end-to-end run loads the grader's tiny Llama from a Q4_1 GGUF and generates on
the torch reference path, the one that calls ``dequantize`` for every layer.

vLLM 0.32 counterpart: none (teaching material).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from chapters.grade_checks.common import PROMPTS, Check, greedy_run
from chapters.grade_checks.tiny_gguf import tiny_gguf_file
from nanoengine.model_executor.layers.quantization import gguf as gguf_method
from nanoengine.model_executor.layers.quantization.gguf_blocks import GGMLType, dequantize

# The integers of the hand-built Q4 blocks: number j is j for j < 16, and 31 - j from 16 on.
Q4_NUMBERS = [*range(16), *range(15, -1, -1)]


def _half(value: float) -> list[int]:
    """The two little-endian bytes of ``value`` as float16."""
    return list(np.array([value], dtype=np.float16).view(np.uint8))


def _q4_body() -> list[int]:
    """16 bytes holding ``Q4_NUMBERS``: number j in byte j's low nibble, number j + 16 in its high one."""
    return [low | (high << 4) for low, high in zip(Q4_NUMBERS[:16], Q4_NUMBERS[16:])]


def _blocks(qtype: GGMLType, labeled: dict[str, list[int]]) -> dict[str, Any]:
    """Each labeled row of bytes through ``dequantize``: the numbers that came back."""
    return {label: dequantize(torch.tensor([row], dtype=torch.uint8), qtype).tolist()
            for label, row in labeled.items()}


# ------------------------------------------------------------------- 2.1 dequantize
def q8_0_blocks(model: str) -> dict[str, Any]:
    """One Q8_0 block of scale 0.5 whose 32 signed bytes are -128 to -8 in steps of 8, then -1, 0, 1,
    then 7 to 117 in steps of 10, then 127; and one of scale -0.25 holding -3 to 28."""
    signed = [-128 + 8 * j for j in range(16)] + [-1, 0, 1] + [7 + 10 * j for j in range(12)] + [127]
    return _blocks(GGMLType.Q8_0, {
        "Q8_0, d = 0.5, bytes -128 to 127": _half(0.5) + [v & 0xFF for v in signed],
        "Q8_0, d = -0.25, bytes -3..28": _half(-0.25) + [v & 0xFF for v in range(-3, 29)],
    })


def q4_0_blocks(model: str) -> dict[str, Any]:
    """Two Q4_0 blocks (scales 0.25 and 3.0) whose numbers 0..15 are 0..15 (low nibbles) and numbers
    16..31 are 15..0 (high nibbles)."""
    return _blocks(GGMLType.Q4_0, {
        f"Q4_0, d = {d}, numbers 0..15 then 15..0": _half(d) + _q4_body() for d in (0.25, 3.0)
    })


def q4_1_blocks(model: str) -> dict[str, Any]:
    """Two Q4_1 blocks, scale 0.5 and minimum -1.25, then scale 2.0 and minimum 7.5, with the
    same numbers as the Q4_0 ones."""
    return _blocks(GGMLType.Q4_1, {
        f"Q4_1, d = {d}, m = {m}, numbers 0..15 then 15..0": _half(d) + _half(m) + _q4_body()
        for d, m in ((0.5, -1.25), (2.0, 7.5))
    })


def whole_matrices(model: str) -> dict[str, Any]:
    """A [3, 96] matrix of seeded normal weights quantized to each format by the ``gguf`` package
    (3 rows of 3 blocks): the shape, dtype and numbers that came back."""
    weights = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    result: dict[str, Any] = {}
    for qtype in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        out = dequantize(torch.from_numpy(quants.quantize(weights, GGMLQuantizationType(int(qtype)))), qtype)
        result[f"{qtype.name}: shape, dtype"] = [list(out.shape), str(out.dtype)]
        result[f"{qtype.name}: numbers"] = out.tolist()
    return result


def e2e_gguf_generation(model: str) -> dict[str, Any]:
    """The grader's tiny Llama written as a Q4_1 GGUF, loaded with its blocks kept and run on the
    torch reference path, 64 KV cache blocks: four 7-token prompts, 8 greedy tokens each."""
    with gguf_method.torch_reference_only():
        run = greedy_run(tiny_gguf_file(GGMLType.Q4_1), PROMPTS, max_tokens=8, max_model_len=64,
                         dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=64)
    return asdict(run)


CHECKS: dict[str, tuple[Check, ...]] = {
    "2.1": (
        Check("Q8_0: each number is d times its byte, read as a signed integer", q8_0_blocks),
        Check("Q4_0: low nibbles are numbers 0-15, high nibbles 16-31, each d * (q - 8)", q4_0_blocks),
        Check("Q4_1: d * q + m, the scale first and the minimum after it", q4_1_blocks),
        Check("whole matrices: [rows, row_bytes] uint8 -> [rows, cols] float32, block after block",
              whole_matrices),
        Check("end to end: the tiny Llama from a Q4_1 GGUF, on the torch reference path", e2e_gguf_generation,
              own_model="the grader's tiny Llama as a Q4_1 GGUF"),
    ),
}
