"""The Triton paged-attention backend: the default on CUDA.

Chapter 7 (the forward pass on a GPU, and why it can be captured as a CUDA
graph). It implements the same ``AttentionImpl`` protocol as the torch reference
backend (``torch_ref.py``) and must agree with it; the kernels themselves live
in ``triton_kernels.py``.
vLLM 0.32 counterpart: ``vllm/v1/attention/backends/triton_attn.py``
(``TritonAttentionImpl``).

What makes it different from the reference, apart from speed: it never reads a
Python list or a ``.item()`` of the metadata. Every size the kernels need is in a
device tensor, so the whole forward pass of a decode batch can be recorded once
as a CUDA graph and replayed with new contents in the same buffers
(worker/cudagraph_runner.py). Padding rows carry slot -1 (nothing written) and a
request with no keys (output zero).
"""

from __future__ import annotations

import torch

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.attention.backends.triton_kernels import paged_attention, reshape_and_cache


def token_to_request(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_tokens] int32: the request each flattened token belongs to.

    Request i owns rows ``[query_start_loc[i], query_start_loc[i + 1])``; a row
    belongs to the last request whose start is at or before it.
    """
    rows = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return (torch.searchsorted(query_start_loc[1:], rows, right=True)).to(torch.int32)


class TritonAttentionImpl:
    """Write this step's K/V with one kernel, attend with another."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D]; key/value [T, Hkv, D]; returns [T, Hq, D].

        T may exceed ``num_actual_tokens`` (CUDA-graph padding): the slot mapping
        and ``token_to_req`` then cover all T rows, padding marked as above.
        """
        num_tokens = query.shape[0]
        slot_mapping = attn_metadata.slot_mapping
        token_to_req = attn_metadata.token_to_req
        if token_to_req is None:
            token_to_req = token_to_request(attn_metadata.query_start_loc, num_tokens)
        reshape_and_cache(key[: slot_mapping.shape[0]], value[: slot_mapping.shape[0]], kv_cache, slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        return paged_attention(
            query,
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            token_to_req,
            scale,
            sliding_window,
        )
