"""Renderers: turn what the user wrote (text, chat messages, token ids) into token ids.

Chapter 5 points out that the renderer is new since the August 2025 blog post
"Inside vLLM: Anatomy of a High-Throughput LLM Inference System": input
rendering was split out of the input processor.
"""
