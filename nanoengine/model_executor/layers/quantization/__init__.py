"""Quantized weights: the formats ``quantization=`` names, and the methods a layer gets for each.

Chapters 2 and 6. vLLM 0.32 counterpart: ``vllm/model_executor/layers/
quantization/__init__.py`` (``QUANTIZATION_METHODS``, ``get_quantization_config``).
One method so far, "gguf" (the name earlier vLLM releases gave it): llama.cpp's
blocks, kept as they are in the file (``gguf.py``, ``gguf_blocks.py``; the file
itself is read by ``model_executor/model_loader/gguf_loader.py``).
"""

from __future__ import annotations

# The values quantization= takes (None: the checkpoint's float weights).
QUANTIZATION_METHODS = ("gguf",)
