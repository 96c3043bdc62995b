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
    Q5_0    2 (d) + 4 (qh) + 16      5.5              d * (q - 16), q in [0, 31]

Two 4-bit integers share a byte: byte ``j`` of a Q4 block holds number ``j`` in
its low nibble and number ``j + 16`` in its high one. E.g. byte ``j`` = 75
= 4 * 16 + 11 of a Q4_0 block with d = 0.5 gives x[j] = 0.5 * (11 - 8) = 1.5
and x[j + 16] = 0.5 * (4 - 8) = -2.0. Q5_0 adds a fifth bit to each: bit ``j``
of the 32-bit ``qh`` is bit 4 of number ``j``.

The K-quants (llama.cpp's ``Q4_K_M`` files mix them with the formats above)
group 8 blocks of 32 into a *super-block* of 256 numbers, whose one float16
scale multiplies small integer scales, one per block of 32 (or of 16):

    format  bytes per 256                              bits per weight   value of q in block s
    Q4_K    2 (d) + 2 (dmin) + 12 (6-bit sc, m) + 128  4.5               d*sc[s] * q - dmin*m[s]
    Q6_K    128 (low 4 bits) + 64 (high 2) + 16 + 2    6.5625            d*sc[s'] * (q - 32)

Q4_K packs its 8 scales and 8 minimums, 6 bits each, into 12 bytes: for
s < 4, sc[s] and m[s] are the low 6 bits of bytes s and s + 4; for s >= 4 the
low 4 bits come from byte s + 4 (sc low nibble, m high nibble) and the top 2
from the top 2 bits of bytes s - 4 (sc) and s (m). Its 128 bytes of nibbles
are read in 4 runs of 32 bytes: run ``p`` holds block 2p in its low nibbles
and block 2p + 1 in its high ones. Q6_K keeps a signed 8-bit scale per 16
numbers (s' = number // 16) and splits each 6-bit q into a nibble and 2 high
bits: in each half of the super-block (128 numbers), numbers 0..31 and 64..95
take the low and high nibbles of the first 32 nibble bytes, 32..63 and 96..127
those of the next 32, and the 2 high bits come from one byte of 32, at bit
shift 0, 2, 4, 6 for the four runs of 32 numbers.

One layer keeps one format, but a fused layer (``qkv_proj``, ``gate_up_proj``)
may find its parts in different ones: llama.cpp's ``Q4_K_M`` keeps v, or the
down projection, wider than q and k. ``to_q8_0`` brings such parts to Q8_0 once,
at load: from Q4_0 and Q5_0 without loss (``d * (q - 16)`` is the Q8_0 number
``q - 16`` with the same ``d``); from the others by quantizing their float
values to Q8_0 as llama.cpp does, which moves each number by at most half a
Q8_0 step (``max|x| / 254`` of its block of 32).

In memory a quantized weight stays what the file holds: a uint8 tensor
[rows, blocks_per_row * bytes_per_block], so a row slice is a slice of the
tensor (``row_bytes``). ``dequantize`` (the first table's formats) and
``dequantize_blocks`` (every format) are the reference every fast path is
tested against (``csrc/cpu/gguf.cpp``); they follow the tables above and
nothing else.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# Numbers per block in the formats of the first table (and per block of a K-quant super-block).
BLOCK = 32
# Numbers per K-quant super-block.
SUPER_BLOCK = 256


class GGMLType(enum.IntEnum):
    """ggml's tensor type ids, as a GGUF file names them (``ggml_type`` in ggml.h)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    BF16 = 30


@dataclass(frozen=True)
class BlockFormat:
    """One quantized format: the bytes of a block of ``numbers`` numbers, and its header."""

    block_bytes: int
    header_bytes: int  # the float16 scale, and for Q4_1 the float16 minimum, before the integers
    numbers: int = BLOCK  # BLOCK, or SUPER_BLOCK for a K-quant


# The formats nanoengine keeps as blocks; ggml's other types are refused by name at load.
FORMATS: dict[GGMLType, BlockFormat] = {
    GGMLType.Q8_0: BlockFormat(block_bytes=34, header_bytes=2),
    GGMLType.Q4_0: BlockFormat(block_bytes=18, header_bytes=2),
    GGMLType.Q4_1: BlockFormat(block_bytes=20, header_bytes=4),
    GGMLType.Q5_0: BlockFormat(block_bytes=22, header_bytes=6),
    GGMLType.Q4_K: BlockFormat(block_bytes=144, header_bytes=16, numbers=SUPER_BLOCK),
    GGMLType.Q6_K: BlockFormat(block_bytes=210, header_bytes=0, numbers=SUPER_BLOCK),
}


def row_bytes(qtype: GGMLType, cols: int) -> int:
    """Bytes of one row of ``cols`` numbers: e.g. Q4_1, 576 columns -> 18 blocks * 20 = 360."""
    numbers = FORMATS[qtype].numbers
    if cols % numbers:
        raise ValueError(f"a {qtype.name} row holds whole blocks of {numbers} numbers; {cols} columns is not a "
                         "multiple")
    return cols // numbers * FORMATS[qtype].block_bytes


def bits_per_weight(qtype: GGMLType) -> float:
    """What one number costs in memory (and in bytes read per token): e.g. Q4_1 -> 5.0."""
    return FORMATS[qtype].block_bytes * 8 / FORMATS[qtype].numbers


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


def dequantize_blocks(qweight: torch.Tensor, qtype: GGMLType) -> torch.Tensor:
    """Blocks of any format kept here -> float32 [rows, cols]: Q8_0, Q4_0 and Q4_1 through
    ``dequantize`` (exercise 2.1), Q5_0 and the K-quants through their own readers below."""
    if qtype in _MORE_FORMATS:
        return _MORE_FORMATS[qtype](qweight.reshape(qweight.shape[0], -1, FORMATS[qtype].block_bytes))
    return dequantize(qweight, qtype)


def _dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0 blocks [rows, blocks, 22] -> float32 [rows, cols]."""
    d = _half(blocks[..., 0:2])  # [rows, blocks, 1]
    qh = blocks[..., 2:6].contiguous().view(torch.int32)  # [rows, blocks, 1], little-endian
    fifth_bits = (qh >> torch.arange(BLOCK, dtype=torch.int32)) & 1  # [rows, blocks, 32]: bit j of qh
    body = blocks[..., 6:]  # [rows, blocks, 16]
    q = torch.cat([body & 0x0F, body >> 4], dim=-1).int() | (fifth_bits << 4)  # [rows, blocks, 32]
    return (d * (q - 16).float()).reshape(blocks.shape[0], -1)  # [rows, cols]


def _dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K super-blocks [rows, supers, 144] -> float32 [rows, cols]."""
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [rows, supers, 1] each
    packed = blocks[..., 4:16].int()  # [rows, supers, 12]: 8 scales and 8 minimums of 6 bits
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]  # [rows, supers, 4] each
    scales = torch.cat([low & 63, (high & 0x0F) | ((low >> 6) << 4)], dim=-1)  # [rows, supers, 8]
    minimums = torch.cat([mid & 63, (high >> 4) | ((mid >> 6) << 4)], dim=-1)  # [rows, supers, 8]
    runs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)  # [rows, supers, 4 runs, 32]
    q = torch.stack([runs & 0x0F, runs >> 4], dim=-2).reshape(*blocks.shape[:2], 8, BLOCK)  # [rows, supers, 8, 32]
    values = (d * scales.float()).unsqueeze(-1) * q.float() - (dmin * minimums.float()).unsqueeze(-1)
    return values.reshape(blocks.shape[0], -1)  # [rows, cols]


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [rows, supers, 210] -> float32 [rows, cols]."""
    rows, supers = blocks.shape[:2]
    nibble_bytes = blocks[..., 0:128].reshape(rows, supers, 2, 2, 32)  # [rows, supers, half, run, 32]
    # Runs 0..3 of 32 numbers in a half: low nibbles of run 0, of run 1, high nibbles of run 0, of run 1.
    nibbles = torch.stack([nibble_bytes & 0x0F, nibble_bytes >> 4], dim=3).reshape(rows, supers, 2, 4, 32)
    high_bytes = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)  # [rows, supers, half, 1, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)  # run k's 2 bits sit at bit 2k
    q = nibbles.int() | (((high_bytes >> shifts) & 3).int() << 4)  # [rows, supers, 2, 4, 32]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, supers, 16]: one per 16
    d = _half(blocks[..., 208:210])  # [rows, supers, 1]
    values = (d * scales).unsqueeze(-1) * (q - 32).float().reshape(rows, supers, 16, 16)  # [rows, supers, 16, 16]
    return values.reshape(rows, -1)  # [rows, cols]


# dequantize_blocks's readers for the formats after the first three (a K-quant's blocks are super-blocks).
_MORE_FORMATS = {GGMLType.Q5_0: _dequantize_q5_0, GGMLType.Q4_K: _dequantize_q4_k, GGMLType.Q6_K: _dequantize_q6_k}


# Formats whose numbers are d * (q - offset): Q8_0 holds them exactly (the same d, q - offset as int8).
_SYMMETRIC_OFFSET = {GGMLType.Q4_0: 8, GGMLType.Q5_0: 16}


def to_q8_0(weight: torch.Tensor, qtype: GGMLType | None) -> torch.Tensor:
    """A weight in blocks of ``qtype`` (or float, ``qtype`` None) -> Q8_0 blocks uint8 [rows, cols / 32 * 34].

    Exact from Q8_0, Q4_0 and Q5_0; otherwise within half a Q8_0 step (see the module docstring).
    """
    if qtype == GGMLType.Q8_0:
        return weight
    if qtype in _SYMMETRIC_OFFSET:
        rows, fmt = weight.shape[0], FORMATS[qtype]
        blocks = weight.reshape(rows, -1, fmt.block_bytes)  # [rows, blocks, block_bytes]
        d = blocks[..., 0:2]  # [rows, blocks, 2]: the fp16 scale, unchanged
        values = dequantize_blocks(weight, qtype).reshape(rows, -1, BLOCK)  # [rows, blocks, 32]
        q = torch.round(values / _half(d)).to(torch.int8)  # q - offset, exactly (d != 0)
        q = torch.where(_half(d) == 0, torch.zeros_like(q), q)  # a zero block: d = 0, every number 0
        return torch.cat([d, q.view(torch.uint8)], dim=-1).reshape(rows, -1)  # [rows, blocks * 34]
    return quantize_q8_0(weight.float() if qtype is None else dequantize_blocks(weight, qtype))


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """float [rows, cols] -> Q8_0 blocks uint8 [rows, cols / 32 * 34], as ggml's quantize_row_q8_0:
    d = max|x| / 127 per block of 32, q = round(x / d)."""
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, BLOCK)  # [rows, blocks, 32]
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [rows, blocks, 1]
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)  # [rows, blocks, 32]
    scale = d.half().view(torch.uint8)  # [rows, blocks, 2]: fp16, little-endian
    return torch.cat([scale, q.view(torch.uint8)], dim=-1).reshape(rows, -1)  # [rows, blocks * 34]
