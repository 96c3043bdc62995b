"""Shared pages (worker/kv_cache_tensors.py): a hybrid model's attention and state views.

The attention view of a page buffer keeps K and V of one block side by side, so
its K half has a block stride of two half pages. Every attention backend must
write and read such a cache exactly as they do a private one, and a state layer
writing its page must leave every attention block of the same buffer alone.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_ref import allocate_blocks, make_attn_metadata

from nanoengine._custom_ops import cpu_ops_available
from nanoengine.attention.backends.torch_ref import TorchRefAttentionImpl
from nanoengine.attention.selector import triton_available
from nanoengine.worker.kv_cache_tensors import attention_view, new_page_buffer, state_views

BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 6, 64, 24
# Larger than 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM elements: unification may pad a page.
PAGE_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4 + 256


def backends() -> list[object]:
    impls: list[object] = [pytest.param(TorchRefAttentionImpl(), id="torch")]
    if cpu_ops_available():
        from nanoengine.attention.backends.cpu_attn import CPUAttentionImpl

        impls.append(pytest.param(CPUAttentionImpl(), id="cpu"))
    if triton_available():  # in Triton's interpreter when there is no GPU (triton_kernels.py)
        from nanoengine.attention.backends.triton_attn import TritonAttentionImpl

        impls.append(pytest.param(TritonAttentionImpl(), id="triton"))
    return impls


def test_attention_view_keeps_a_block_in_its_page() -> None:
    """Block b's K and V rows are bytes of page b only; the view has the usual shape."""
    pages = new_page_buffer(NUM_BLOCKS, PAGE_BYTES, torch.device("cpu"))
    cache = attention_view(pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    assert cache.shape == (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    assert cache.data_ptr() == pages.data_ptr()
    cache[0, 5].fill_(1.0)
    cache[1, 5].fill_(2.0)
    touched = (pages != 0).any(dim=1).nonzero().flatten().tolist()
    assert touched == [5]
    assert cache.stride(1) == PAGE_BYTES // 4 and cache.stride(0) == BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM


def test_state_views_do_not_overlap_and_fit_the_page() -> None:
    """Conv and recurrent state views of one page lie one after the other."""
    pages = new_page_buffer(NUM_BLOCKS, PAGE_BYTES, torch.device("cpu"))
    conv, ssm = state_views(pages, ((40, 3), (2, 16, 16)), torch.float32)
    assert conv.shape == (NUM_BLOCKS, 40, 3) and ssm.shape == (NUM_BLOCKS, 2, 16, 16)
    conv[7].fill_(3.0)
    assert ssm.abs().sum() == 0 and conv[6].abs().sum() == 0 and conv[8].abs().sum() == 0
    ssm[7].fill_(4.0)
    assert (conv[7] == 3.0).all()
    with pytest.raises(ValueError, match="cannot hold"):
        state_views(pages, ((PAGE_BYTES,),), torch.float32)


@pytest.mark.parametrize("impl", backends())
def test_backends_read_and_write_shared_pages_like_a_private_cache(impl: TorchRefAttentionImpl) -> None:
    """A prefill then a mixed decode+chunk step give the same output rows and the same
    cached K/V on a shared-page cache as on a private [2, num_blocks, ...] cache; a state
    layer then rewriting other pages of the same buffer changes no attention output."""
    torch.manual_seed(0)
    private = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pages = new_page_buffer(NUM_BLOCKS, PAGE_BYTES, torch.device("cpu"))
    shared = attention_view(pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    lengths = [9, 14, 30]
    blocks = allocate_blocks(lengths, BLOCK_SIZE, NUM_BLOCKS - 4)  # the last 4 pages: states
    steps = [([0, 0, 0], [5, 14, 12]), ([5, 0, 12], [1, 0, 18]), ([6, 14, 30], [1, 0, 0])]
    for computed, new in steps:
        live = [i for i, n in enumerate(new) if n]
        order = sorted(live, key=lambda i: new[i] != 1)  # decodes first
        md = make_attn_metadata(
            [computed[i] for i in order], [new[i] for i in order], [blocks[i] for i in order], BLOCK_SIZE
        )
        tokens = md.num_actual_tokens
        query = torch.randn(tokens, NUM_HEADS, HEAD_DIM)
        key, value = torch.randn(2, tokens, NUM_KV_HEADS, HEAD_DIM)
        want = impl.forward(query, key, value, private, md, 0.125)
        got = impl.forward(query, key, value, shared, md, 0.125)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(shared, private, atol=0, rtol=0)
    # A state layer's pages: rewriting them leaves the attention blocks as they were.
    conv, ssm = state_views(pages[NUM_BLOCKS - 4 :], ((40, 3), (2, 16, 16)), torch.float32)
    conv.fill_(7.0)
    ssm.fill_(-7.0)
    torch.testing.assert_close(shared[:, : NUM_BLOCKS - 4], private[:, : NUM_BLOCKS - 4], atol=0, rtol=0)
