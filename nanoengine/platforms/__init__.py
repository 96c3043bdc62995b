"""What the machine the engine runs on can do (vLLM 0.32: ``vllm/platforms/``)."""
