"""Attention backends: a plain-torch reference (any device) and, on CUDA, Triton kernels."""
