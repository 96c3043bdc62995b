"""ZmqConnector: KV blocks pulled from a prefill server by a decode server over TCP (chapter 10).

``metadata.py`` holds what crosses from the scheduler side to the worker side
and the messages on the wire, ``scheduler.py`` the decisions (torch-free),
``worker.py`` the sockets and the tensor copies.

vLLM 0.32 counterpart: ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``
in its pull mode (``pull_scheduler.py``, ``pull_worker.py``, ``metadata.py``).
"""
