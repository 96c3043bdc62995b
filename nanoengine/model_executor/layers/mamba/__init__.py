"""State-space ("mamba") layers: Gated DeltaNet and its plain-torch ops (chapter 7).

A hybrid model mixes these with attention layers; each keeps a fixed-size
state per request instead of a KV cache. vLLM 0.32 counterpart:
``vllm/model_executor/layers/mamba/``.
"""
