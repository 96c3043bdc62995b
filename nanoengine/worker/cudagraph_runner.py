"""Record decode steps as CUDA graphs at start-up and replay them (GPU only).

Chapter 7 (``generate(...)``): the model runner's fast path for decode. At the
end of construction (after the KV cache exists, since the graphs read it) one
graph per captured batch size records the whole forward pass plus the LM head,
reading from static input buffers. A decode step then copies its (padded, see
``worker/cudagraph_dispatcher.py``) inputs into those buffers and replays: one
launch instead of hundreds. The eager path stays the reference; chapter 7 and
``scripts/gpu_check.sh`` check the two agree.
vLLM 0.32 counterpart: ``vllm/v1/worker/gpu_model_runner.py``
(``capture_model``, ``_capture_cudagraphs``) and
``vllm/compilation/cuda_graph.py`` (``CUDAGraphWrapper``).

Only the Triton attention backend can be captured: the torch reference reads
Python lists of sequence lengths, which a graph would freeze at capture time.
"""

from __future__ import annotations

import torch

from nanoengine.attention.backends.abstract import AttentionMetadata
from nanoengine.model_executor.models.registry import CausalLM
from nanoengine.worker.input_batch import StepInputs


class CUDAGraphRunner:
    """Static buffers sized for the largest graph, and one graph per batch size."""

    def __init__(self, model: CausalLM, max_batch_size: int, block_table_width: int, device: torch.device):
        self.model = model
        self.device = device
        # Every graph reads prefixes of these buffers; replay() overwrites them.
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_batch_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((max_batch_size, block_table_width), dtype=torch.int32, device=device)
        # A decode batch: request i is row i, so both are fixed ranges.
        self.query_start_loc = torch.arange(max_batch_size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # [size, vocab] fp32, written by each replay
        self.captured_bytes = 0

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=size,
            num_decodes=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[0] * size,
            token_to_req=self.query_start_loc[:size],
        )

    def _run(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self._metadata(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """Record one graph per size, largest first, all in one memory pool.

        With the buffers at their reset values (slot -1, seq_len 0) a capture
        writes nothing into the KV cache. Largest first: smaller graphs then
        reuse the pool's blocks instead of growing it.
        """
        before = torch.cuda.memory_reserved(self.device)
        pool = None
        for size in sorted(sizes, reverse=True):
            # Warm-up outside the graph: Triton compiles and autotunes here,
            # which a capture must never do.
            self._run(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._run(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.captured_bytes = torch.cuda.memory_reserved(self.device) - before

    def replay(self, padded: StepInputs) -> torch.Tensor:
        """Copy a padded decode batch into the buffers, replay; logits [size, vocab]."""
        size = padded.input_ids.shape[0]
        md = padded.attn_metadata
        self.input_ids[:size].copy_(padded.input_ids)
        self.positions[:size].copy_(padded.positions)
        self.slot_mapping[:size].copy_(md.slot_mapping)
        self.seq_lens[:size].copy_(md.seq_lens)
        width = md.block_table.shape[1]
        self.block_table[:size, :width].copy_(md.block_table)
        self.graphs[size].replay()
        return self.logits[size]
