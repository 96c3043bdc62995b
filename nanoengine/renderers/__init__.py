"""Renderers: turn what the user wrote (text, chat messages, token ids) into token ids.

Chapter 5 notes that the renderer is new since the Aug 2025 "Anatomy of vLLM"
blog: input rendering was split out of the input processor.
"""
