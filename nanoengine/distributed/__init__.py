"""Processes working together: tensor parallelism (chapter 6) and moving KV cache between
engines (chapter 5's WAITING_FOR_REMOTE_KVS, chapter 8's P/D split).

``parallel_state`` holds the process groups, ``communication_op`` the collectives the
parallel layers call, ``utils`` the arithmetic of the split; ``kv_transfer`` the KV connectors.
vLLM 0.32 counterpart: ``vllm/distributed/``.
"""
