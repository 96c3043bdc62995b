"""Moving KV cache between engines (chapter 5's WAITING_FOR_REMOTE_KVS, chapter 8's P/D split).

vLLM 0.32 counterpart: ``vllm/distributed/`` (here only ``kv_transfer``).
"""
