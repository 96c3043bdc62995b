"""The model side of the worker: layers, model definitions and the weight loader.

Chapter 6 (``LLM(...)`` construction) calls ``model_loader.get_model`` from
``Worker.load_model``; chapter 7 (``generate(...)``) runs the resulting module once
per engine step.
vLLM 0.32 counterpart: ``vllm/model_executor/`` (``layers/``, ``models/``,
``model_loader/``).

The layers are vLLM's tensor-parallel ones (``layers/linear.py``,
``layers/vocab_parallel_embedding.py``): at one rank each is a single matmul or
lookup, at N ranks each holds and loads its slice (chapter 6). There is no
quantization; the fused projections (``qkv_proj``, ``gate_up_proj``) and the
weight-loading path are kept because they are what makes a vLLM model file read
the way it does.
"""
