"""Glue to Hugging Face transformers: find a model's folder, read its config and tokenizer.

Chapter 6 (``LLM(...)`` construction) walks through how a model name becomes a local
directory and a ``PretrainedConfig``. vLLM 0.32 counterpart: ``vllm/transformers_utils/``.
"""
