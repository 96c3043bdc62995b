"""The OpenAI-compatible server (chapter 8): ``api_server`` (routes), ``serving`` (handlers), ``protocol`` (bodies), ``metrics``.

vLLM 0.32 counterpart: ``vllm/entrypoints/openai/``.
"""
