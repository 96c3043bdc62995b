"""Attention backends (chapter 7): a plain-torch reference (any device) and, on CUDA, Triton kernels."""
