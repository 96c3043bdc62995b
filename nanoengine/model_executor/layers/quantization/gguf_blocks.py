"""GGML's block formats, as llama.cpp stores weights in a GGUF file, and a plain torch dequantizer for each.

Chapter 2 (bytes per token: what a decode step reads), chapter 6 (what a
quantized model keeps in memory). vLLM 0.32 counterpart: none (see
``gguf.py``); the formats are ggml's (``ggml-common.h`` in llama.cpp), and the
``gguf`` Python package ports their (de)quantization to numpy, which the tests
hold this module to.

A quantized matrix [rows, cols] is stored row by row, each row cut into blocks
of 32 numbers along ``cols``; each block keeps a float16 scale ``d`` (and, for
Q4_1, a float16 minimum ``m``) and one small integer per number:

    format  bytes per block of 32   bits per weight   value of integer q
    Q8_0    2 (d) + 32               8.5              d * q,        q in [-128, 127]
    Q4_0    2 (d) + 16               4.5              d * (q - 8),  q in [0, 15]
    Q4_1    2 (d) + 2 (m) + 16       5.0              d * q + m,    q in [0, 15]

Two 4-bit integers share a byte: byte ``j`` of a Q4 block holds number ``j`` in
its low nibble and number ``j + 16`` in its high one. E.g. byte ``j`` = 75
= 4 * 16 + 11 of a Q4_0 block with d = 0.5 gives x[j] = 0.5 * (11 - 8) = 1.5
and x[j + 16] = 0.5 * (4 - 8) = -2.0.

In memory a quantized weight stays what the file holds: a uint8 tensor
[rows, blocks_per_row * bytes_per_block], so a row slice is a slice of the
tensor (``row_bytes``). ``dequantize`` is the reference every fast path is
tested against (``csrc/cpu/gguf.cpp``); it follows the table above and
nothing else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# Numbers per block in every format kept here.
BLOCK = 32


class GGMLType(enum.IntEnum):
    """ggml's tensor type ids, as a GGUF file names them (``ggml_type`` in ggml.h)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30


@dataclass(frozen=True)
class BlockFormat:
    """One quantized format: the bytes of a block of ``BLOCK`` numbers, and its header."""

    block_bytes: int
    header_bytes: int  # the float16 scale, and for Q4_1 the float16 minimum, before the integers


# The formats nanoengine keeps as blocks; ggml's other types are refused by name at load.
FORMATS: dict[GGMLType, BlockFormat] = {
    GGMLType.Q8_0: BlockFormat(block_bytes=34, header_bytes=2),
    GGMLType.Q4_0: BlockFormat(block_bytes=18, header_bytes=2),
    GGMLType.Q4_1: BlockFormat(block_bytes=20, header_bytes=4),
}


def row_bytes(qtype: GGMLType, cols: int) -> int:
    """Bytes of one row of ``cols`` numbers: e.g. Q4_1, 576 columns -> 18 blocks * 20 = 360."""
    if cols % BLOCK:
        raise ValueError(f"a {qtype.name} row holds whole blocks of {BLOCK} numbers; {cols} columns is not a multiple")
    return cols // BLOCK * FORMATS[qtype].block_bytes


def bits_per_weight(qtype: GGMLType) -> float:
    """What one number costs in memory (and in bytes read per token): e.g. Q4_1 -> 5.0."""
    return FORMATS[qtype].block_bytes * 8 / BLOCK


def dequantize(qweight: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """uint8 [rows, row_bytes] blocks -> float32 [rows, cols], by the table of this module."""
    fmt = FORMATS[qtype]
    rows = qweight.shape[0]
    blocks = qweight.reshape(rows, -1, fmt.block_bytes)  # [rows, blocks, block_bytes]
    d = _half(blocks[..., 0:2])  # [rows, blocks, 1]
    body = blocks[..., fmt.header_bytes:]  # [rows, blocks, block_bytes - header]
    if qtype == GGMLType.Q8_0:
        values = d * body.view(torch.int8).float()  # [rows, blocks, 32]
    else:
        # Low nibbles are numbers 0..15 of the block, high nibbles 16..31.
        q = torch.cat([body & 0x0F, body >> 4], dim=-1).float()  # [rows, blocks, 32]
        values = d * (q - 8) if qtype == GGMLType.Q4_0 else d * q + _half(blocks[..., 2:4])
    return values.reshape(rows, -1)  # [rows, cols]


def _half(two_bytes: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 stored as two uint8 -> float32, keeping a trailing axis of 1."""
    return two_bytes.contiguous().view(torch.float16).float()  # [..., 1]
