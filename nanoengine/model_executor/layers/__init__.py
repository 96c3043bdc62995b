"""Building blocks shared by every decoder model: norms, RoPE, activations,
linear projections and the vocabulary embedding (chapter 7).

vLLM 0.32 counterpart: ``vllm/model_executor/layers/``.
"""
