"""StructuredOutputManager: grammars that constrain which tokens may come next.

Chapter 5 (engine skeleton) shows where it sits -- a member of ``EngineCore``
beside the scheduler -- and why ``step()`` computes its bitmask *while* the
forward pass runs. vLLM 0.32 counterpart: ``vllm/v1/structured_output/__init__.py``
(``StructuredOutputManager``, backed by xgrammar).

This foundation release has no ``SamplingParams`` field that asks for a grammar,
so no request is ever structured and ``grammar_bitmask`` returns None; the
step's shape (bitmask computed between ``execute_model`` and ``sample_tokens``)
is already the final one, and the model runner already applies a bitmask.
"""

from __future__ import annotations

from nanoengine.config import EngineConfig
from nanoengine.core.sched.output import GrammarOutput, SchedulerOutput


class StructuredOutputManager:
    """Compiles grammars and produces per-step token bitmasks."""

    def __init__(self, engine_config: EngineConfig) -> None:
        # The bitmask has one column per vocabulary entry.
        self.vocab_size = engine_config.model_config.vocab_size

    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The allowed-token mask for the scheduled structured requests; None when
        there are none, which (for now) is always."""
        del scheduler_output  # read once grammars exist
        return None
