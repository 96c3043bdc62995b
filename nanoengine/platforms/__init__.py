"""What the machine the engine runs on can do: the CPU's bf16 instructions.

Chapter 6 (``dtype="auto"``) and chapter 7 (bf16 on a CPU).
vLLM 0.32 counterpart: ``vllm/platforms/`` (one ``Platform`` class per device kind).
"""
