"""The contract between the model runner and an attention backend.

Chapter 7 (``generate(...)``) builds this metadata for a real step; chapter 4
explains the block table and slot mapping it carries.
vLLM 0.32 counterpart: ``vllm/v1/attention/backends/`` (``AttentionMetadata``
per backend, built by an ``AttentionMetadataBuilder`` in the model runner).

All scheduled tokens of all requests are flattened into one batch of
``num_actual_tokens`` rows. Requests are ordered decodes first (exactly one query
token each), then prefills (a whole prompt, or one chunk of it), as vLLM's
``reorder_batch`` does, so a backend can treat the first ``num_decodes`` requests
as a uniform batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and which cached K/V each query may read."""

    num_actual_tokens: int
    num_reqs: int
    num_decodes: int  # the first num_decodes requests have query_len == 1
    # Token index where each request's queries start; request i owns
    # rows [query_start_loc[i], query_start_loc[i + 1]).
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on device
    # Tokens in the KV cache for each request once this step's tokens are written
    # (computed before + scheduled now): the key length each query sees at most.
    seq_lens: torch.Tensor  # [num_reqs] int32, on device
    # Row i lists request i's physical block ids, padded with 0 past its end.
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on device
    # Flat cache slot (block_id * block_size + offset) for each scheduled token.
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, on device
    # The same offsets as Python lists: reference loops index them without syncs.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # The request of each token row, [num_tokens] int32 on device. Kernels that
    # must not read Python lists (CUDA graphs) take it from here; None means
    # "derive it from query_start_loc" (the Triton backend does).
    token_to_req: torch.Tensor | None = None
    # Hybrid models only (Qwen3.5): the state slot of each request, one row per
    # state group; a Gated DeltaNet layer of group g keeps request i's conv and
    # recurrent state at slot state_indices[g, i] of its state tensors. None for
    # models without such layers. [num_state_groups, num_reqs] int64, on device.
    state_indices: torch.Tensor | None = None
    # Models with several K/V groups (chapter 4: Gemma 3's global and local
    # layers): each K/V group's block table and slot mapping, in group order
    # (block_table and slot_mapping above are the first group's). A request
    # has one table per group, so a layer must read its own group's. Empty:
    # the model has one K/V group.
    kv_group_block_tables: tuple[torch.Tensor, ...] = ()
    kv_group_slot_mappings: tuple[torch.Tensor, ...] = ()

    def for_kv_group(self, index: int) -> AttentionMetadata:
        """This step as the layers of K/V group ``index`` (0, 1, ...) see it: their group's tables."""
        if index == 0:
            return self
        return replace(
            self, block_table=self.kv_group_block_tables[index], slot_mapping=self.kv_group_slot_mappings[index]
        )


def kernel_window(sliding_window: int | None) -> int:
    """A sliding window as the C++ and Triton kernels take it: a plain integer, 0 for "no window"."""
    return 0 if sliding_window is None else sliding_window
