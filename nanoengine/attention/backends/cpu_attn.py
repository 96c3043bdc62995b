"""The CPU paged-attention backend: C++ kernels that read the KV cache in place.

Chapter 7 (what a CPU decode step spends its time on, and the two ways to remove
a copy: fuse it away, or never make it). Chapter 4 explains the block table
and slot mapping the kernels walk.
vLLM 0.32 counterpart: ``vllm/v1/attention/backends/cpu_attn.py``
(``CPUAttentionBackendImpl``), whose kernels live in vLLM's ``csrc/cpu/``.

It is the torch reference backend (``torch_ref.py``) with three steps swapped for
C++ (``nanoengine/csrc/cpu/``, loaded by ``_custom_ops.py``); the two attention
kernels take a sliding window too (chapter 4), and never read the keys before it:

* the K/V write becomes one ``memcpy`` per token row (``reshape_and_cache``),
  instead of two ``index_copy_`` calls and their dispatch overhead;
* decode attention reads each request's blocks where they lie
  (``paged_decode_attention``) instead of gathering them into a padded copy
  first. At a batch of 32 decodes with ~250 cached tokens each, that copy was
  the single biggest non-matmul cost of a SmolLM2 step. Each KV head's rows
  are read once for all the query heads that share it (GQA);
* every prefill (and chunked-prefill) request of the step is handled by one
  ``paged_prefill_attention`` call, tiled like a GEMM (``prefill_attention.cpp``),
  instead of one ``scaled_dot_product_attention`` per request and layer, which
  reached only ~50-75 GFLOP/s at prompt lengths of 64-256. Head sizes that are
  not a multiple of 32 keep the reference path.

The kernels compile on first use (see ``_custom_ops.py``). Without a compiler,
or if the build fails, the selector warns once and uses the torch reference
instead, so the engine never depends on this file.
"""

from __future__ import annotations

import torch

from nanoengine._custom_ops import load_cpu_ops
from nanoengine.attention.backends.abstract import AttentionMetadata, kernel_window
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl


class CPUAttentionImpl(TorchRefAttentionImpl):
    """The reference backend with the K/V write and the decode batch in C++."""

    def __init__(self) -> None:
        self.kernels = load_cpu_ops()

    def _write(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # kv_cache[0] / kv_cache[1] are contiguous [num_blocks, block_size, Hkv, D] halves.
        self.kernels.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping)

    def _decode_batch(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """query [num_decodes, Hq, D] -> [num_decodes, Hq, D], no gathered copy.

        A sliding window's blocks before it are not even read (the kernel
        starts at its first key), so its decode costs a window, not a history.
        """
        query = query.contiguous()  # a strided view of the qkv projection otherwise
        out = torch.empty_like(query)
        num_decodes = query.shape[0]
        self.kernels.paged_decode_attention(
            out, query, kv_cache[0], kv_cache[1], md.block_table, md.seq_lens[:num_decodes], scale,
            kernel_window(sliding_window),
        )
        return out

    def _prefill_batch(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        """Every prefill request's rows of ``output`` [T, Hq, D], in one kernel call."""
        if not self.kernels.paged_prefill_supports(query.shape[-1]):
            super()._prefill_batch(output, query, kv_cache, md, scale, sliding_window)
            return
        self.kernels.paged_prefill_attention(
            output,
            query,
            kv_cache[0],
            kv_cache[1],
            md.block_table,
            md.query_start_loc,
            md.seq_lens,
            md.num_decodes,
            scale,
            kernel_window(sliding_window),
        )
